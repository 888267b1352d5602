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
