"""The one training loop (`pipeline.training.loop`): every Trainer of the pipeline comes from `build_trainer`, which
turns Lightning's checkpointing and validation on only where the job asks for them; the curves write their plots."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.core.params import TrainParams
from pipeline.training.curves import CurveRecorder
from pipeline.training.loop import build_trainer
from tests.factories import ROOT


def test_build_trainer_is_the_only_trainer_in_the_pipeline():
    made = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "pipeline").rglob("*.py"))
            if re.search(r"\bL\.Trainer\(|\bTrainer\(", p.read_text())]
    assert made == ["pipeline/training/loop.py"]


def test_checkpointing_and_validation_only_where_asked(tmp_path: Path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    params = TrainParams(precision="32-true")
    plain = build_trainer(params, tmp_path, [], enable_progress_bar=False, validate=False)
    assert plain.checkpoint_callback is None  # no unread default checkpoint in the work dir
    assert plain.limit_val_batches == 0
    best = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="val_acc", mode="max")
    validated = build_trainer(params, tmp_path, [best], enable_progress_bar=False)
    assert validated.checkpoint_callback is best
    assert validated.limit_val_batches == 1.0


def test_curves_write_their_plots_and_final_loss(tmp_path: Path):
    curves = CurveRecorder()
    curves.train_rows = [{"step": i, "train_loss": float(i), "lr": 0.1} for i in range(1, 13)]
    curves.write(tmp_path)
    assert (tmp_path / "train.csv").read_text().splitlines()[:2] == ["step,train_loss,lr", "1,1.0,0.1"]
    assert (tmp_path / "val.csv").read_text().splitlines() == ["step,epoch,val_acc,val_loss"]
    assert curves.final_loss(10) == sum(range(3, 13)) / 10
    assert CurveRecorder().final_loss() == 0.0 and CurveRecorder().samples_per_s == 0.0


def test_curves_hold_one_row_per_optimizer_step_with_the_windows_mean_loss():
    """With gradient accumulation (2 micro-batches a step, the epoch's 5th batch a partial window) each optimizer
    step is one row, stamped with the step it completed, whose loss is its window's mean."""
    from types import SimpleNamespace

    import torch

    progress = SimpleNamespace(is_last_batch=False)
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, global_step=0, accumulate_grad_batches=2,
                              num_training_batches=5, callback_metrics={},
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 0.1}])],
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    batch = {"labels": torch.zeros(4), "attention_mask": torch.ones(4, 8)}
    curves = CurveRecorder()
    curves.on_train_epoch_start(trainer, None)
    for batch_idx, loss in enumerate([1.0, 3.0, 2.0, 4.0, 5.0]):
        trainer.callback_metrics = {"train_loss": torch.tensor(loss)}
        progress.is_last_batch = batch_idx == 4
        if batch_idx % 2 == 1 or batch_idx == 4:  # Lightning steps before the batch-end hooks run
            trainer.global_step += 1
        curves.on_train_batch_start(trainer, None, batch, batch_idx)
        curves.on_train_batch_end(trainer, None, None, batch, batch_idx)
    assert curves.train_rows == [{"step": 1, "train_loss": 2.0, "lr": 0.1}, {"step": 2, "train_loss": 3.0, "lr": 0.1},
                                 {"step": 3, "train_loss": 5.0, "lr": 0.1}]
    assert curves.final_loss() == 10.0 / 3 and curves.samples == 20
