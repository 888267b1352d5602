"""A training job's curves, its one logging callback: every step's loss and learning rate, every validation's
accuracy and loss, and the honest training throughput, written as DVC plots and sent to MLflow.

Why not Lightning's loggers: a resumed run must hold every step once. Lightning's `CSVLogger` and `MLFlowLogger`
write from the step a run starts at, so a resumed attempt would either lose the points before its checkpoint or
(continuing the interrupted run) keep the points that attempt logged after it. Here the curves are part of every
checkpoint (`state_dict`), and both the CSV files and the MLflow points come from them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np

from pipeline.training.curve_files import MetricSink, write_curves
from pipeline.training.resume import steps_after


class CurveRecorder(L.Callback):
    """Training curves for DVC plots (`write`) and MLflow (`sink`), plus the training throughput with validation
    time excluded.

    One training row per optimizer step, stamped with the step it completed: with `train.grad_accum` > 1 its loss
    is the mean over that step's accumulation window (the micro-batches whose gradients the step applied), so the
    curve and `final_loss` count steps, not micro-batches.

    The curves are part of every checkpoint (`state_dict`), and the MLflow points come from them (`sink`, rank 0,
    sent every `flush_every` points): a resumed run first sends the checkpoint's curves again, so its MLflow run
    holds every step once, neither the points the interrupted run logged after its last checkpoint nor a gap."""

    def __init__(self, sink: MetricSink | None = None, flush_every: int = 10) -> None:
        self.train_rows: list[dict[str, float]] = []
        self.val_rows: list[dict[str, float]] = []
        self.samples = 0
        self.tokens = 0
        self.train_seconds = 0.0
        self.sink = sink
        self.flush_every = flush_every
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._t: float | None = None
        self._window: list[float] = []  # the losses of the micro-batches since the last optimizer step

    def state_dict(self) -> dict[str, Any]:
        return {"train_rows": self.train_rows, "val_rows": self.val_rows, "samples": self.samples,
                "tokens": self.tokens, "train_seconds": self.train_seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_rows = list(state_dict["train_rows"])
        self.val_rows = list(state_dict["val_rows"])
        self.samples, self.tokens = int(state_dict["samples"]), int(state_dict["tokens"])
        self.train_seconds = float(state_dict["train_seconds"])
        self._pending = [_point(r) for r in sorted(self.train_rows + self.val_rows, key=lambda r: r["step"])]
        self._window = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._window = []  # Lightning steps on the epoch's last batch: no window spans two epochs

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t is not None:
            self.train_seconds += time.perf_counter() - self._t
        self.samples += len(batch["labels"]) * trainer.world_size
        self.tokens += int(batch["attention_mask"].sum()) * trainer.world_size
        if not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self._window.append(float(loss))
        # Between two optimizer steps `global_step` has not moved yet: a row there would repeat the previous step's
        # number (step 0 before the first update) with a micro-batch's loss.
        if steps_after(trainer, batch_idx) and self._window:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self._add(self.train_rows, {"step": trainer.global_step, "train_loss": float(np.mean(self._window)),
                                        "lr": lr})
            self._window = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        if "val_acc" in m:
            self._add(self.val_rows, {"step": trainer.global_step, "epoch": trainer.current_epoch,
                                      "val_acc": float(m["val_acc"]), "val_loss": float(m["val_loss"])})
            self.flush()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.flush()

    def _add(self, rows: list[dict[str, float]], row: dict[str, float]) -> None:
        rows.append(row)
        self._pending.append(_point(row))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Send the points not sent yet to the sink (if any)."""
        if self.sink is not None and self._pending:
            self.sink(self._pending)
        self._pending = []

    @property
    def samples_per_s(self) -> float:
        """Training samples a second, validation excluded (0 before any step)."""
        return self.samples / self.train_seconds if self.train_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Non-padding training tokens a second, validation excluded (0 before any step)."""
        return self.tokens / self.train_seconds if self.train_seconds else 0.0

    def final_loss(self, last: int = 10) -> float:
        """The mean training loss of the `last` optimizer steps (0 before any step; each step's loss is its
        accumulation window's mean): where a run ended, less noisy than one batch."""
        losses = [row["train_loss"] for row in self.train_rows[-last:]]
        return float(np.mean(losses)) if losses else 0.0

    def write(self, plots_dir: Path) -> None:
        """`train.csv` (step, loss, lr) and `val.csv` (step, epoch, accuracy, loss) for `dvc plots`."""
        write_curves(plots_dir, self.train_rows, self.val_rows)


def _point(row: Mapping[str, float]) -> tuple[int, dict[str, float]]:
    return int(row["step"]), {k: float(v) for k, v in row.items() if k != "step"}
