"""Training that survives its process: resumable checkpoints outside DVC's outputs, and the decision to resume.

Every training job (finetune, distill, QAT) owns `<train.checkpoint_dir>/<job>/`. Lightning writes a full
checkpoint there every `train.checkpoint_every_n_steps` optimizer steps (model, optimizer, LR scheduler, AMP scaler,
loop counters, callback states) and this module adds what Lightning does not keep or decide:

- the position inside the epoch (`LoaderPosition`: the length-bucketed sampler rebuilds the epoch's order from its
  seed and skips the batches already trained) and the RNG streams, so a resumed run continues the same trajectory;
- a checkpoint when SIGTERM, SIGINT or SIGUSR1 arrives. The signal only raises a flag; the checkpoint is written at
  the next batch boundary, where weights, optimizer and data position agree (saving from an exception handler, as
  `OnExceptionCheckpoint` does, can catch an optimizer step half applied), then the process exits with 128 + the
  signal number. A second Ctrl-C stops at once;
- atomic writes (a file is complete or absent: a kill mid-write never leaves a checkpoint a later run trusts);
- the fingerprint (the job's settings, a digest of its input files, a digest of the training code): the next run
  resumes from the newest intact checkpoint when it matches and starts fresh, saying why in one line, when not.

The directory is removed when the job finishes, so nothing stale is left to resume from and nothing of it reaches
DVC's outputs or the served archive.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pipeline.core.io import write_json
from pipeline.core.params import flatten
from pipeline.data.batching import LoaderPosition

log = logging.getLogger(__name__)

#: Signals that checkpoint and stop a training job (SIGUSR1: the usual preemption notice of schedulers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: The code whose change makes an old checkpoint another trajectory (relative to the `pipeline` package).
TRAINING_CODE = ("training", "data", "modeling.py")
#: `train` keys that change where or how fast a job runs, not what it computes: not part of the fingerprint.
RESUME_NEUTRAL = frozenset({
    "checkpoint_every_n_steps", "checkpoint_dir", "resume", "launcher", "min_nodes", "max_restarts",
    "rdzv_endpoint", "rdzv_id", "num_workers", "pin_memory", "persistent_workers", "profiler", "threads",
})
_STEP = re.compile(r"step=(\d+)")


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


@dataclass(frozen=True)
class Fingerprint:
    """What makes a checkpoint belong to this run: the job's settings, its input files and the training code."""

    settings: dict[str, Any]
    data: str
    code: str

    def differences(self, saved: Fingerprint) -> list[str]:
        """What changed since `saved`, one short phrase each (settings as `section.key old -> new`)."""
        out = []
        old, new = flatten(saved.settings), flatten(self.settings)
        for key in sorted(old.keys() | new.keys()):
            if old.get(key, "<unset>") != new.get(key, "<unset>"):
                out.append(f"{key} {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}")
        if saved.data != self.data:
            out.append("input data changed")
        if saved.code != self.code:
            out.append("training code changed (" + ", ".join(f"pipeline/{c}" for c in TRAINING_CODE) + ")")
        return out


def digest_paths(paths: Sequence[Path]) -> str:
    """SHA-256 over the files under `paths` (names relative to each path, then contents), caches skipped."""
    h = hashlib.sha256()
    for root in paths:
        if not root.exists():  # the job's own loading reports a missing input; here it is just part of the digest
            h.update(f"<missing {root.name}>".encode())
            continue
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0")
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def training_code_digest() -> str:
    """Digest of the training code (`TRAINING_CODE`) as it is on disk."""
    package = Path(__file__).resolve().parents[1]
    return digest_paths([package / rel for rel in TRAINING_CODE])


def fingerprint(settings: Mapping[str, Any], inputs: Sequence[Path]) -> Fingerprint:
    """The fingerprint of a job with these settings (JSON-able sections) reading these input files/dirs."""
    plain = json.loads(json.dumps(settings, default=str))  # tuples, paths ... as a re-read file would have them
    return Fingerprint(plain, digest_paths(inputs), training_code_digest())


def trajectory_settings(train: Mapping[str, Any]) -> dict[str, Any]:
    """A `train` section without the keys that do not change the trained weights (`RESUME_NEUTRAL`)."""
    return {k: v for k, v in train.items() if k not in RESUME_NEUTRAL}


@dataclass(frozen=True)
class ResumePlan:
    """How a job starts: from `checkpoint` (at optimizer step `step`) or fresh, and why, in one line."""

    job: str
    checkpoint: Path | None
    step: int
    reason: str
    previous_run_id: str | None = None  # the MLflow run of the interrupted attempt, whose curves continue

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

    @property
    def ckpt_path(self) -> str | None:
        """For `trainer.fit(ckpt_path=...)`."""
        return str(self.checkpoint) if self.checkpoint is not None else None

    def record(self) -> dict[str, Any]:
        """For `metrics/*.json` and MLflow: whether it resumed, from which step, and why (not)."""
        return {"resumed": self.resumed, "resumed_from_step": self.step, "resume_reason": self.reason}


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, but through a temporary file renamed into place: a checkpoint file is whole
    or absent, whenever the process dies."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, target)


def is_rank_zero() -> bool:
    """True in the process that writes files and logs: global rank 0 under torchrun (RANK), else the launching
    process of a Lightning DDP job (LOCAL_RANK and NODE_RANK unset or 0)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


class CheckpointStore:
    """`<root>/<job>/`: the job's fingerprint, the MLflow run of its last attempt, and its checkpoints
    (`periodic/`, `best/`, `preempt-step=N.ckpt`). Only rank 0 changes it; other ranks read the same decision."""

    FINGERPRINT = "fingerprint.json"
    RUN = "run.json"

    def __init__(self, root: Path, job: str, every_n_steps: int = 0, writer: bool | None = None) -> None:
        self.dir = Path(root) / job
        self.job = job
        self.every_n_steps = every_n_steps
        self.writer = is_rank_zero() if writer is None else writer

    @classmethod
    def for_job(cls, train: Any, job: str) -> CheckpointStore:
        """The store of `job` as `train` (TrainParams) places and paces it."""
        return cls(Path(train.checkpoint_dir), job, train.checkpoint_every_n_steps)

    @property
    def best_dir(self) -> Path:
        return self.dir / "best"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Intact checkpoint files, newest step first (a torch checkpoint is a zip: a cut-off one is not)."""
        found = []
        for p in self.dir.rglob("*.ckpt") if self.dir.is_dir() else []:
            m = _STEP.search(p.name)
            if m and zipfile.is_zipfile(p):
                found.append((int(m.group(1)), p))
        return sorted(found, key=lambda sp: (sp[0], sp[1].stat().st_mtime), reverse=True)

    def plan(self, current: Fingerprint, resume: bool = True) -> ResumePlan:
        """Resume from the newest intact checkpoint if the saved fingerprint equals `current`; otherwise clear the
        directory (rank 0) and start fresh. The reason is logged and returned."""
        saved = self._read_fingerprint()
        found = self.checkpoints()
        previous = self._read_run()
        if not resume:
            plan = ResumePlan(self.job, None, 0, "fresh start: train.resume is false")
        elif not found:
            plan = ResumePlan(self.job, None, 0, f"fresh start: no checkpoint in {self.dir}")
        elif saved is None:
            plan = ResumePlan(self.job, None, 0, f"fresh start: {self.dir} has checkpoints but no fingerprint")
        elif changed := current.differences(saved):
            plan = ResumePlan(self.job, None, 0, f"fresh start, the checkpoint at step {found[0][0]} is for other "
                                                 f"inputs: {'; '.join(changed)}")
        else:
            step, path = found[0]
            plan = ResumePlan(self.job, path, step, f"resuming from step {step} ({path})", previous)
        if not plan.resumed and self.writer:
            self.clear()
        if self.writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.dir / self.FINGERPRINT, asdict(current))
        log.info("%s: %s", self.job, plan.reason)
        return plan

    def remember_run(self, run_id: str) -> None:
        """The MLflow run of this attempt: a later resumed attempt continues its curves."""
        if self.writer:
            write_json(self.dir / self.RUN, {"mlflow_run_id": run_id})

    def clear(self) -> None:
        """Remove the job's checkpoints (rank 0): called when the job has finished and on a fresh start."""
        if self.writer and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)

    def callbacks(self, position: LoaderPosition | None = None) -> list[L.Callback]:
        """Periodic checkpoints (if `every_n_steps`) and the resume/signal handling, for a Trainer's callbacks."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        out: list[L.Callback] = [ResumableTraining(self.dir, position)]
        if self.every_n_steps:
            out.insert(0, ModelCheckpoint(dirpath=str(self.dir / "periodic"), filename="{step}", monitor=None,
                                          save_top_k=1, every_n_train_steps=self.every_n_steps,
                                          save_on_train_epoch_end=False, enable_version_counter=False))
        return out

    def _read_fingerprint(self) -> Fingerprint | None:
        try:
            raw = json.loads((self.dir / self.FINGERPRINT).read_text())
            return Fingerprint(raw["settings"], raw["data"], raw["code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _read_run(self) -> str | None:
        try:
            return str(json.loads((self.dir / self.RUN).read_text())["mlflow_run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


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
    """Keeps the epoch position and RNG streams in every checkpoint and restores them; turns SIGTERM, SIGINT and
    SIGUSR1 into a checkpoint at the next batch boundary followed by `Preempted`."""

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
            done = done * int(state["world_size"]) // max(trainer.world_size, 1)
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
        log.warning("received %s: writing a checkpoint at the end of this batch, then stopping",
                    signal.Signals(signum).name)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stop = self.requested is not None
        if trainer.world_size > 1:  # a signal to any rank stops all of them at the same batch
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
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
        trainer.save_checkpoint(path)  # every rank takes part; rank 0 writes
        written = path if trainer.is_global_zero else None
        stop = Preempted(signum, trainer.global_step, written)
        log.warning("%s", stop)
        raise stop

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous = {}


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
