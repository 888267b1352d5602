"""Unit: a run resumed from any checkpoint a job leaves (periodic, best, preempted) trains the batches an
uninterrupted run trains, in the same order, and runs every validation it runs, over several epochs: three epochs of
12 batches of a linear model, the length-bucketed sampler, Lightning's own loop. Before, a checkpoint written
between an epoch's last batch and its validation skipped that validation (the best checkpoint missed it), and
Lightning never advanced the sampler's epoch, so every epoch repeated the first one's order and a resumed epoch
past the first skipped by the wrong position (a resume at an epoch's end trained nothing more)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from pipeline.data.batching import LengthBucketBatchSampler, LoaderPosition
from pipeline.training.checkpoints import CheckpointStore
from pipeline.training.loop import best_checkpoint
from pipeline.training.resume import PeriodicCheckpoint, Preempted, ResumableTraining
from tests.unit.training.test_resume_callback import REVIEWS, Linear, _data

EPOCHS, BATCHES = 3, REVIEWS // 2
#: The validation score at each step that validates: the best is the first epoch's, so a resumed run that forgot
#: a validation it had run would keep a later, worse one.
SCORES = {6: 0.6, 12: 0.9, 18: 0.3, 24: 0.5, 30: 0.4, 36: 0.7}


class Scored(Linear):
    """Validates with a score set by the step (`SCORES`): which checkpoint is best does not depend on the data."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_acc", torch.tensor(SCORES[self.trainer.global_step]))


class Killed(Exception):
    """A SIGKILL, as far as the run's files are concerned: nothing runs after it."""


class Record(L.Callback):
    """The batches trained (by content) and the steps validated at; kills the run at step `kill_at` (at the start of
    that step's batch, or at the start of its validation with `in_validation`), or raises the stop flag (a SIGTERM)
    at the start of step `signal_at`'s batch."""

    def __init__(self, kill_at: int | None = None, in_validation: bool = False, signal_at: int | None = None) -> None:
        self.batches: list[float] = []
        self.validated: list[int] = []
        self.kill_at, self.in_validation, self.signal_at = kill_at, in_validation, signal_at
        self.resumable: ResumableTraining | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.kill_at and not self.in_validation:
            raise Killed
        if trainer.global_step == self.signal_at and self.resumable is not None:
            self.resumable.requested = int(signal.SIGTERM)
        # the batch, and a draw from the RNG the step would take its dropout from (restored on resume)
        self.batches.append((round(float(batch[0].sum()), 4), round(float(torch.rand(())), 6)))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.kill_at and self.in_validation:
            raise Killed

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validated.append(trainer.global_step)


def fit(directory: Path, record: Record, *, every: int = 0, validate_every: float = 1.0,
        ckpt: Path | None = None) -> tuple[int, str]:
    """The job's callbacks as `pipeline.training.loop.fit` builds them; returns the steps trained in all and the
    best checkpoint's name."""
    L.seed_everything(0, verbose=False)  # as `loop.seed_run`: a resumed run then restores the saved streams
    position = LoaderPosition()
    resumable = ResumableTraining(directory, position, signals=())
    record.resumable = resumable
    best = best_checkpoint(directory / "best")
    callbacks: list[L.Callback] = [
        best, *([PeriodicCheckpoint(directory / "periodic", every)] if every else []), resumable, record]
    sampler = LengthBucketBatchSampler([4] * REVIEWS, 2, pool_batches=2, seed=1, position=position)
    trainer = L.Trainer(max_epochs=EPOCHS, val_check_interval=validate_every, accelerator="cpu", devices=1,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(directory))
    try:
        trainer.fit(Scored(), train_dataloaders=DataLoader(_data(), batch_sampler=sampler),
                    val_dataloaders=DataLoader(_data(), batch_size=8), ckpt_path=str(ckpt) if ckpt else None)
    except (Killed, Preempted):
        pass
    return trainer.global_step, Path(best.best_model_path).name


def resume_point(directory: Path) -> tuple[Path | None, int]:
    """Where the job's store resumes from (`CheckpointStore.checkpoints`), and its step; (None, 0): a fresh start."""
    found = CheckpointStore(directory.parent, directory.name).checkpoints()
    if not found:
        return None, 0
    _, path = found[0]
    return path, int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def test_every_epoch_is_shuffled_anew(tmp_path):
    """Lightning sets the epoch through the batch sampler's `sampler`: each epoch has its own order of the reviews."""
    record = Record()
    fit(tmp_path, record)
    epochs = [record.batches[e * BATCHES : (e + 1) * BATCHES] for e in range(EPOCHS)]
    assert len({tuple(batches) for batches in epochs}) == EPOCHS
    assert sorted(epochs[0]) != epochs[0]  # shuffled within the epoch too


SCENARIOS = {
    # name: (periodic every, validations per epoch, kill at step, kill in its validation, SIGTERM at step)
    "periodic, mid second epoch": (6, 1.0, 20, False, None),
    "periodic at an epoch's last batch (written after the next batch)": (12, 1.0, 14, False, None),
    "killed in the validation after the periodic step": (12, 1.0, 24, True, None),
    "only a best checkpoint (no resume point: a fresh start)": (0, 1.0, 13, False, None),
    "periodic at a mid-epoch validation": (6, 0.5, 7, False, None),
    "stop signal at the first epoch's last batch": (0, 1.0, None, False, 11),
    "stop signal mid second epoch": (0, 1.0, None, False, 16),
    "stop signal at the last batch of all": (0, 1.0, None, False, EPOCHS * BATCHES - 1),
}


#: Scenarios that leave no resume point: the best checkpoint, written where a validation ends, is not one.
FRESH = {"only a best checkpoint (no resume point: a fresh start)"}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_resumed_run_trains_and_validates_as_an_uninterrupted_one(tmp_path, name):
    every, validate_every, kill_at, in_validation, signal_at = SCENARIOS[name]
    whole = Record()
    steps, best = fit(tmp_path / "whole", whole, validate_every=validate_every)
    assert steps == EPOCHS * BATCHES and best.startswith("best-step=12-")
    first = Record(kill_at, in_validation, signal_at)
    fit(tmp_path / "run", first, every=every, validate_every=validate_every)
    ckpt, step = resume_point(tmp_path / "run")
    assert (ckpt is None) == (name in FRESH)
    resumed = Record()
    assert fit(tmp_path / "run", resumed, every=every, validate_every=validate_every, ckpt=ckpt) == (
        EPOCHS * BATCHES, best)  # the same best checkpoint: no validation forgotten
    assert whole.batches[:step] + resumed.batches == whole.batches  # the same batches and draws, in order
    assert [s for s in first.validated if s <= step] + resumed.validated == whole.validated


def test_no_resume_point_sits_between_a_batch_and_its_validation_or_at_an_epochs_end(tmp_path):
    """The periodic checkpoint of an epoch's last step is written after the next epoch's first batch: killed in
    the validation, or at the start of that batch, the run has none yet."""
    for kill_at, in_validation in ((BATCHES, True), (BATCHES, False)):
        fit(tmp_path / str(in_validation), Record(kill_at=kill_at, in_validation=in_validation), every=BATCHES)
        assert resume_point(tmp_path / str(in_validation)) == (None, 0)
    fit(tmp_path / "later", Record(kill_at=BATCHES + 2), every=BATCHES)
    assert resume_point(tmp_path / "later")[1] == BATCHES + 1
