"""Unit: `ResumableTraining` inside one process, on a linear model: a stop signal waits for the batch that steps the
optimizer (gradient accumulation), and an elastic resume with another world size moves Lightning's batch count with
the sampler's skip, so the epoch ends where its loader does and validates there."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loops.progress import _BatchProgress
from torch.utils.data import DataLoader, TensorDataset

from pipeline.data.batching import LengthBucketBatchSampler, LoaderPosition
from pipeline.training.resume import Preempted, ResumableTraining

REVIEWS = 24  # 12 batches of 2


class Linear(L.LightningModule):
    """Counts the training batches it sees and the validation passes it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.trained = 0
        self.validations = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained += 1
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.layer(x).argmax(-1) == y).float().mean())

    def on_validation_epoch_end(self) -> None:
        self.validations += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(L.Callback):
    """Raises the stop flag at the start of batch `batch` of the epoch, as a signal arriving then would."""

    def __init__(self, resumable: ResumableTraining, batch: int) -> None:
        self.resumable, self.batch = resumable, batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.batch:
            self.resumable.requested = int(signal.SIGTERM)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(REVIEWS, 4, generator=g), torch.randint(0, 2, (REVIEWS,), generator=g))


def _fit(tmp_path: Path, *, accumulate: int = 1, stop_at: int | None = None, ckpt: Path | None = None) -> Linear:
    """One epoch of 12 batches (the length-bucketed sampler, which skips what a checkpoint says was trained)."""
    position = LoaderPosition()
    resumable = ResumableTraining(tmp_path, position, signals=())  # no handlers: the flag is raised by StopAt
    callbacks: list[L.Callback] = [resumable] + ([StopAt(resumable, stop_at)] if stop_at is not None else [])
    sampler = LengthBucketBatchSampler([4] * REVIEWS, 2, pool_batches=2, seed=1, position=position)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=accumulate,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        default_root_dir=str(tmp_path))
    module = Linear()
    trainer.fit(module, train_dataloaders=DataLoader(_data(), batch_sampler=sampler),
                val_dataloaders=DataLoader(_data(), batch_size=8), ckpt_path=str(ckpt) if ckpt else None)
    module.steps = trainer.global_step
    return module


def _preempt(tmp_path: Path, **kwargs: Any) -> tuple[Path, dict[str, Any]]:
    with pytest.raises(Preempted) as stopped:
        _fit(tmp_path, **kwargs)
    path = stopped.value.checkpoint
    assert path is not None and path.is_file()
    return path, torch.load(path, map_location="cpu", weights_only=True)


def test_a_stop_inside_an_accumulation_window_waits_for_its_optimizer_step(tmp_path):
    # accumulating 3 batches a step, a signal during the first batch stops after the third, at step 1: no
    # accumulated gradient is lost and the resumed run starts a whole window
    path, state = _preempt(tmp_path, accumulate=3, stop_at=0)
    assert state["global_step"] == 1 and state["resume"]["batches_done"] == 3
    resumed = _fit(tmp_path / "resumed", accumulate=3, ckpt=path)
    assert resumed.trained == 12 - 3  # every batch of the epoch once
    assert resumed.steps == 4  # windows 3+3+3 and the epoch's last, partial one: as an uninterrupted epoch


def _fake_trainer(accumulate: int, batches: int, is_last_batch: bool = False) -> Any:
    saved: list[Path] = []
    progress = SimpleNamespace(is_last_batch=is_last_batch, current=SimpleNamespace(processed=0))
    return SimpleNamespace(accumulate_grad_batches=accumulate, num_training_batches=batches, world_size=1,
                           global_step=7, is_global_zero=True, current_epoch=0, saved=saved,
                           enable_validation=False,  # a job that does not validate (QAT): no validation to wait for
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                           save_checkpoint=lambda path, weights_only=None: saved.append(path))


@pytest.mark.parametrize(("batch_idx", "stops"), [(0, False), (2, False), (3, True), (4, False), (5, True)])
def test_a_pending_stop_checkpoints_only_after_a_batch_that_steps(tmp_path, batch_idx, stops):
    """4 batches a step, 6 in the epoch: the optimizer steps after batches 3 and 5 (the epoch's last, a partial
    window), and only there is the checkpoint written."""
    callback = ResumableTraining(tmp_path, signals=())
    callback.requested = int(signal.SIGUSR1)
    trainer = _fake_trainer(accumulate=4, batches=6)
    if stops:
        with pytest.raises(Preempted) as stopped:
            callback.on_train_batch_end(trainer, None, None, None, batch_idx)
        assert stopped.value.code == 128 + signal.SIGUSR1
        assert trainer.saved == [tmp_path / "preempt-step=7.ckpt"]
    else:
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)
        assert trainer.saved == [] and callback.requested == signal.SIGUSR1  # still pending


def test_a_loader_that_ends_early_is_a_stepping_batch(tmp_path):
    callback = ResumableTraining(tmp_path, signals=())
    callback.requested = int(signal.SIGTERM)
    trainer = _fake_trainer(accumulate=4, batches=6, is_last_batch=True)  # the loader said so before batch 5
    with pytest.raises(Preempted):
        callback.on_train_batch_end(trainer, None, None, None, 1)


def _restarted(progress: dict[str, Any]) -> _BatchProgress:
    """Lightning's batch progress as its epoch loop restores it from a checkpoint (`_TrainingEpochLoop.reset`): a
    checkpoint written at the end of a batch counts it processed but not completed, and the restart completes it."""
    restored = _BatchProgress()
    restored.load_state_dict(progress)
    total = restored.total
    if total.started == total.ready and total.processed == total.started and total.completed == total.processed - 1:
        restored.increment_completed()
    restored.reset_on_restart()
    return restored


def _checkpoint(batches_done: int, world_size: int, earlier: int = 37) -> dict[str, Any]:
    """The parts of a checkpoint written at the end of batch `batches_done` of the second epoch (after `earlier`
    batches in the first) that a resume reads: that batch is processed but not yet completed."""

    def counters(n: int) -> dict[str, int]:
        return {"ready": n, "started": n, "processed": n, "completed": n - 1}

    progress = {"total": counters(earlier + batches_done), "current": counters(batches_done), "is_last_batch": False}
    return {"resume": {"epoch": 1, "batches_done": batches_done, "world_size": world_size, "rng": None},
            "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}


@pytest.mark.parametrize(("saved_world", "world", "done", "expected"), [(2, 1, 6, 12), (1, 2, 8, 4), (4, 3, 5, 6),
                                                                       (2, 2, 6, 6)])
def test_an_elastic_resume_moves_lightnings_batch_count_with_the_samplers_skip(saved_world, world, done, expected):
    """Where the group's size changed, the sampler skips the rescaled number of batches and Lightning's restored
    count of the epoch's batches says the same: a smaller group (more batches a rank) would otherwise end its
    loader before the count reached the epoch's length and skip the epoch-end validation, a larger one would reach
    the length early and drop the rest of the epoch."""
    checkpoint = _checkpoint(done, saved_world)
    position = LoaderPosition()
    ResumableTraining(Path("unused"), position, signals=()).on_load_checkpoint(
        SimpleNamespace(world_size=world), None, checkpoint)
    assert position.take(1) == expected
    restored = _restarted(checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"])
    assert restored.current.ready == restored.current.completed == expected
    assert restored.total.ready == 37 + expected  # the run's count moves with it


def test_an_epoch_resumed_by_a_smaller_group_ends_where_its_loader_does_and_validates(tmp_path):
    """A checkpoint of 2 processes after 3 batches each, resumed by 1: the 1 process skips 6 of the epoch's 12
    batches, trains the other 6 and validates at the epoch's end, as an uninterrupted epoch does."""
    path, state = _preempt(tmp_path, stop_at=2)
    assert state["resume"]["batches_done"] == 3
    state["resume"]["world_size"] = 2  # as 2 processes would have written it, 3 batches each
    torch.save(state, path)
    resumed = _fit(tmp_path / "resumed", ckpt=path)
    assert resumed.trained == 6
    assert resumed.validations == 1
