"""Training that survives its process: resumable checkpoints outside DVC's outputs, and the decision to resume.

Every training job (finetune, distill, QAT) owns `<train.checkpoint_dir>/<job>/`. Lightning writes a full
checkpoint there every `train.checkpoint_every_n_steps` optimizer steps (model, optimizer, LR scheduler, AMP scaler,
loop counters, callback states) and this module adds what Lightning does not keep or decide:

- the position inside the epoch (`LoaderPosition`: the length-bucketed sampler rebuilds the epoch's order from its
  seed and skips the batches already trained) and the RNG streams, so a resumed run continues the same trajectory;
- a checkpoint when SIGTERM, SIGINT or SIGUSR1 arrives. The signal only raises a flag; the checkpoint is written at
  the end of the next batch that steps the optimizer, where weights, optimizer and data position agree (saving from
  an exception handler, as `OnExceptionCheckpoint` does, can catch an optimizer step half applied; between steps of
  `train.grad_accum`, the accumulated gradients would be lost), then the process exits with 128 + the signal
  number. A second Ctrl-C stops at once;
- atomic writes (a file is complete or absent: a kill mid-write never leaves a checkpoint a later run trusts);
- the fingerprint (the job's settings, a digest of its input files, a digest of the training code): the next run
  resumes from the newest intact checkpoint when it matches and starts fresh, saying why in one line, when not.

This module holds the callback (`ResumableTraining`: epoch position, RNG streams, signals) and `Preempted`; the
checkpoint directory and the resume decision are `pipeline.training.checkpoints`, the fingerprint
`pipeline.training.fingerprint`. The directory is removed when the job finishes, so nothing stale is left to
resume from and nothing of it reaches DVC's outputs or the served archive.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import numpy as np
import torch

from pipeline.data.batching import LoaderPosition

log = logging.getLogger(__name__)

#: Signals that checkpoint and stop a training job (SIGUSR1: the usual preemption notice of schedulers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(SystemExit):
    """Training stopped by a signal after checkpointing; the exit status is 128 + the signal number, as a shell
    reports a process killed by that signal, so `dvc repro` and schedulers see the stage as not done."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint written (not rank 0)"
        return (f"stopped by {signal.Signals(self.signum).name} at step {self.step}; {where}; "
                "run the stage again to resume")


def rng_states() -> dict[str, Any]:
    """Every RNG stream a training step may draw from (dropout, Python and NumPy users), as tensors and plain
    values only, so the checkpoint still loads with `torch.load(weights_only=True)`."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    states: dict[str, Any] = {"torch": torch.get_rng_state(),
                              "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
                              "python": [version, list(internal), py_gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Put back what `rng_states` took."""
    torch.set_rng_state(states["torch"])
    name, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, py_gauss = states["python"]
    random.setstate((version, tuple(internal), py_gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class ResumableTraining(L.Callback):
    """Keeps the epoch position and RNG streams in every checkpoint and restores them (an elastic resume with another
    world size moves both the sampler's skip and Lightning's batch count); turns SIGTERM, SIGINT and SIGUSR1 into a
    checkpoint after the next optimizer step followed by `Preempted`."""

    def __init__(self, directory: Path, position: LoaderPosition | None = None,
                 signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.directory = Path(directory)
        self.position = position
        self.signals = tuple(signals)
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._rng_to_restore: Mapping[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "ResumableTraining"

    # what a checkpoint carries beyond Lightning's own state
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        checkpoint["resume"] = {"epoch": trainer.current_epoch, "batches_done": progress.processed,
                                "world_size": trainer.world_size, "rng": rng_states()}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("resume")
        if not state:
            return
        done = int(state["batches_done"])
        if state.get("world_size", 1) != trainer.world_size:  # elastic: same share of the epoch, new sharding
            saved = done
            done = done * int(state["world_size"]) // max(trainer.world_size, 1)
            rescale_batch_progress(checkpoint, done - saved)
            log.warning("resuming with %d processes where the checkpoint had %d: the epoch continues at batch %d",
                        trainer.world_size, state["world_size"], done)
        if self.position is not None:
            self.position.resume_at(int(state["epoch"]), done)
        self._rng_to_restore = state.get("rng")
        # The position is restored here, not by a stateful DataLoader, which Lightning's check looks for.
        warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._rng_to_restore is not None:  # where the interrupted run stood when it saved
            set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    # signals
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested = None
        if not _main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._request)

    def _request(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = signum
        log.warning("received %s: writing a checkpoint after the next optimizer step, then stopping",
                    signal.Signals(signum).name)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stop = self.requested is not None
        if trainer.world_size > 1:  # a signal to any rank stops all of them at the same batch
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        # Between two optimizer steps (`train.grad_accum` > 1) the accumulated gradients are in `.grad`, which no
        # checkpoint holds, while `batches_done` would count their batches: the resumed run would skip them. The
        # stop waits for the batch that steps (every rank reaches it at the same batch), and past a validation
        # that follows it (`validates_after`): to the next batch that steps, the next epoch's first at an epoch's
        # end (`PeriodicCheckpoint` says why not the epoch's end itself), or the training's end.
        if stop and resumes_exactly_after(trainer, batch_idx):
            self._stop(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()
        if self.requested is not None:  # arrived after the last batch: keep the finished training, then stop
            self._stop(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def _stop(self, trainer: L.Trainer) -> None:
        signum = self.requested or int(signal.SIGTERM)
        path = self.directory / f"preempt-step={trainer.global_step}.ckpt"
        # the full state a resume needs (optimizer, loops, callbacks); every rank takes part, rank 0 writes
        trainer.save_checkpoint(path, weights_only=False)
        written = path if trainer.is_global_zero else None
        stop = Preempted(signum, trainer.global_step, written)
        log.warning("%s", stop)
        raise stop

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous = {}


def steps_after(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether the optimizer steps after batch `batch_idx` of the epoch (Lightning's own rule): the batch completes
    an accumulation window of `accumulate_grad_batches`, or it is the epoch's last, where Lightning steps on a
    partial window. (`batch_idx` counts from the epoch's start, a resumed run's included.)"""
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or ends_epoch(trainer, batch_idx)


def ends_epoch(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether batch `batch_idx` is the epoch's last: the loader said so, or the epoch's length is reached."""
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches


def validates_after(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether Lightning validates right after batch `batch_idx` of the epoch (its rule for a loader with a length:
    the epoch's last batch, or every `val_check_batch` batches, in the epochs `check_val_every_n_epoch` picks).

    A checkpoint must not be written there, between the batch and its validation: Lightning resumes such a
    checkpoint past the validation, which then never runs (the best checkpoint misses it, and a run resumed at an
    epoch's end keeps the best of the epochs before). Where this says yes wrongly, a save only waits one batch."""
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every:
        return False
    if ends_epoch(trainer, batch_idx):
        return True
    interval = trainer.val_check_batch
    return interval is not None and interval != float("inf") and (batch_idx + 1) % int(interval) == 0


def resumes_exactly_after(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether a checkpoint written after batch `batch_idx` is one a resumed run continues exactly from: the optimizer
    has stepped (`steps_after`) and no validation follows (`validates_after`). Periodic checkpoints and a stop
    signal's are written only there."""
    return steps_after(trainer, batch_idx) and not validates_after(trainer, batch_idx)


class PeriodicCheckpoint(L.Callback):
    """A resumable checkpoint every `every_n_steps` optimizer steps, `directory/step=N.ckpt` (the one before it
    removed), written where a resumed run continues exactly: after the batch that reached the step, or, where
    validation follows that batch (`validates_after`), after the next batch that steps, so past the validation and
    the best checkpoint's save. Lightning's `ModelCheckpoint(every_n_train_steps)` writes between the batch and its
    validation. Not at an epoch's end either: the next epoch's loader draws its seed from the RNG the checkpoint
    holds after that point, so a run resumed there would train the next epoch with other dropout; after the next
    epoch's first batch, both runs have drawn it. (At the training's end nothing is left to resume.)"""

    def __init__(self, directory: Path, every_n_steps: int) -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        self.directory = Path(directory)
        self.every_n_steps = every_n_steps
        self.due = False  # a step was reached whose checkpoint waits for a validation
        self.saved_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        self.due = self.due or (step > 0 and step % self.every_n_steps == 0 and step != self.saved_step)
        if self.due and resumes_exactly_after(trainer, batch_idx):
            self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        self.due, self.saved_step = False, trainer.global_step
        path = self.directory / f"step={trainer.global_step}.ckpt"
        # the full state a resume needs (optimizer, loops, callbacks); every rank takes part, rank 0 writes
        trainer.save_checkpoint(path, weights_only=False)
        if trainer.is_global_zero:
            # deleted only now that the new one is on disk (`AtomicCheckpointIO` syncs it and its folder)
            for older in self.directory.glob("step=*.ckpt"):
                if older != path:
                    older.unlink(missing_ok=True)


def rescale_batch_progress(checkpoint: dict[str, Any], shift: int) -> None:
    """Move Lightning's restored position in the epoch (`epoch_loop.batch_progress`, the batches this rank has
    taken) by `shift` batches, where an elastic resume with another world size moved the sampler's skip.

    Lightning ends the epoch when that count reaches the epoch's length and validates when it is a multiple of the
    validation interval; left at the old world size's value while the sampler skips the rescaled number, a smaller
    group (more batches per rank) ended the epoch's loader before the count reached the length, so the epoch-end
    validation never ran, and a larger group reached the length early and dropped the rest of the epoch. Every
    counter of the current epoch and of the run moves by the same amount, so the relations between them, which
    Lightning reads to tell where in a batch the checkpoint was written, are kept (a checkpoint written at the end
    of a batch counts that batch processed but not completed: shifted to the epoch's start, `completed` is -1 until
    Lightning's restart adds the batch back)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress or not shift:
        return
    for scope in ("current", "total"):
        counters = progress[scope]
        for name in ("ready", "started", "processed", "completed"):
            counters[name] = int(counters[name]) + shift


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
