"""The training curves' files for `dvc plots` (`train.csv`, `val.csv`) and where their points go in MLflow: the
format alone, without Lightning, so that a stage that trains nothing (a skipped student) writes empty curves
without importing it. `pipeline.training.curves` records them during training."""

from __future__ import annotations

import csv
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pipeline.core.io import replaced_on_success

#: Where the curves' points go: (step, {name: value}) pairs, e.g. an MLflow run (`StageRun.log_steps`).
MetricSink = Callable[[Sequence[tuple[int, Mapping[str, float]]]], None]

#: The DVC plots files and their columns.
TRAIN_COLUMNS = ("step", "train_loss", "lr")
VAL_COLUMNS = ("step", "epoch", "val_acc", "val_loss")


def write_curves(plots_dir: Path, train_rows: Sequence[Mapping[str, float]] = (),
                 val_rows: Sequence[Mapping[str, float]] = ()) -> None:
    """`train.csv` (step, loss, lr) and `val.csv` (step, epoch, accuracy, loss) in `plots_dir`; no rows gives the
    header alone (a job that did not train)."""
    files = (("train.csv", train_rows, TRAIN_COLUMNS), ("val.csv", val_rows, VAL_COLUMNS))
    for name, rows, cols in files:
        with replaced_on_success(plots_dir / name) as tmp, tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=cols)
            writer.writeheader()
            writer.writerows(rows)
