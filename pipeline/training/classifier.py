"""Accelerated finetuning with Lightning: the module, the data module, the trainer and the optimizer.

Accelerations are params (`TrainParams`): mixed precision, `torch.compile`, length-bucketed batches with
dynamic padding, gradient accumulation, DataLoader workers, the torch profiler, and DDP/FSDP/DeepSpeed."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAccuracy

from pipeline.core.errors import UserError
from pipeline.core.params import TrainParams
from pipeline.core.stage import lightning_lines_once
from pipeline.data.batching import Collator, LengthBucketBatchSampler, LoaderPosition, TokenizedDataset
from pipeline.data.tokens import read_tokenized

log = logging.getLogger(__name__)


class AccelerationUnavailable(UserError):
    """A requested acceleration needs hardware or a package this machine lacks."""


def check_accelerations(params: TrainParams) -> None:
    """Fail fast, before any data is loaded, when params ask for what this machine cannot do."""
    cuda = torch.cuda.is_available()
    if params.accelerator in ("gpu", "cuda") and not cuda:
        raise AccelerationUnavailable(
            f"train.accelerator={params.accelerator} but no CUDA device is visible; "
            "use the CPU profile (accelerator: cpu) on this machine"
        )
    if params.precision == "16-mixed" and not cuda:
        raise AccelerationUnavailable("train.precision=16-mixed needs CUDA; on CPU use bf16-mixed or 32-true")
    if params.strategy == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError as exc:
            raise AccelerationUnavailable("train.strategy=deepspeed needs `pip install deepspeed` and CUDA") from exc


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool = True) -> torch.optim.AdamW:
    """AdamW without weight decay on biases and LayerNorms; `fused` runs one kernel per step for all tensors.

    On CPU PyTorch's default AdamW loops over the tensors one by one, a visible share of a training step with
    the large word-embedding table; the fused kernel updates every tensor in one pass (RESULTS.md, training).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=True if fused else None)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each encoder layer's activations in the backward pass (`train.gradient_checkpointing`).

    Hugging Face's switch, with PyTorch's non-reentrant checkpoint (the one PyTorch recommends: it works with
    `torch.compile`, autocast and inputs that need no gradient)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class SentimentClassifier(L.LightningModule):
    """A Hugging Face sequence classifier trained with AdamW and linear warm-up/decay."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, warmup_ratio: float,
                 compile_model: bool = False, compile_mode: str = "default", fused_optimizer: bool = True,
                 gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.model = model.train()  # from_pretrained returns eval mode; training wants dropout on
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.lr = lr
        self.fused_optimizer = fused_optimizer
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.compile_model = compile_model
        self.compile_mode = compile_mode
        self._forward_fn: Any = None  # compiled callable kept off the module tree so checkpoints stay plain
        self.val_acc = BinaryAccuracy()

    def _fn(self) -> Any:
        if self._forward_fn is None:
            fn = torch.compile(self.model, mode=self.compile_mode, dynamic=True) if self.compile_model else self.model
            object.__setattr__(self, "_forward_fn", fn)  # plain attribute: not a registered submodule
        return self._forward_fn

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._fn()(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        self.val_acc(logits.argmax(-1), batch["labels"])
        n = len(batch["labels"])
        self.log("val_loss", loss, prog_bar=False, sync_dist=True, batch_size=n)
        self.log("val_acc", self.val_acc, prog_bar=True, batch_size=n)

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = build_optimizer(self.model, self.lr, self.weight_decay, fused=self.fused_optimizer)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = get_linear_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class IMDBDataModule(L.LightningDataModule):
    """Tokenized splits from the prepare stage, batched by length."""

    def __init__(self, tokenized_dir: str | Path, params: TrainParams, pad_id: int = 0,
                 shorten_train: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        super().__init__()
        self.tokenized_dir = Path(tokenized_dir)
        self.params = params
        self.shorten_train = shorten_train  # the training window (`train.max_length`); other splits stay whole
        self.collate = Collator(pad_id=pad_id, multiple_of=params.pad_to_multiple_of)
        self.datasets: dict[str, TokenizedDataset] = {}
        self.position = LoaderPosition()  # where a resumed run re-enters the training epoch

    def setup(self, stage: str | None = None) -> None:
        for split in ("train", "val", "test"):
            if split not in self.datasets:
                df = read_tokenized(self.tokenized_dir, split)
                ids = df["input_ids"].tolist()
                if split == "train" and self.shorten_train is not None:
                    ids = [self.shorten_train(x) for x in ids]
                self.datasets[split] = TokenizedDataset(ids, df["label"].to_numpy())

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        p = self.params
        ds = self.datasets[split]
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        common: dict[str, Any] = {
            "collate_fn": self.collate, "num_workers": p.num_workers, "pin_memory": p.pin_memory,
            "persistent_workers": p.persistent_workers,
        }
        # Evaluation is bucketed too (no shuffle): same predictions, far less padding. Without bucketing, pools of
        # one batch give plain shuffled batches (still sharded under DDP, and resumable mid-epoch like the others).
        sampler = LengthBucketBatchSampler(
            ds.lengths, batch_size, pool_batches=p.bucket_pool_batches if p.bucketing else 1,
            shuffle=shuffle, seed=p.seed, num_replicas=world, rank=rank,
            position=self.position if shuffle else None,
        )
        return DataLoader(ds, batch_sampler=sampler, **common)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.params.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.params.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.params.eval_batch_size, shuffle=False)


#: Where a recorder sends its points: (step, {name: value}) pairs, e.g. an MLflow run (`StageRun.log_steps`).
MetricSink = Callable[[Sequence[tuple[int, Mapping[str, float]]]], None]


class CurveRecorder(L.Callback):
    """Training curves for DVC plots and MLflow, plus the honest training throughput (validation time excluded).

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

    def state_dict(self) -> dict[str, Any]:
        return {"train_rows": self.train_rows, "val_rows": self.val_rows, "samples": self.samples,
                "tokens": self.tokens, "train_seconds": self.train_seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_rows = list(state_dict["train_rows"])
        self.val_rows = list(state_dict["val_rows"])
        self.samples, self.tokens = int(state_dict["samples"]), int(state_dict["tokens"])
        self.train_seconds = float(state_dict["train_seconds"])
        self._pending = [_point(r) for r in sorted(self.train_rows + self.val_rows, key=lambda r: r["step"])]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t is not None:
            self.train_seconds += time.perf_counter() - self._t
        self.samples += len(batch["labels"]) * trainer.world_size
        self.tokens += int(batch["attention_mask"].sum()) * trainer.world_size
        loss = trainer.callback_metrics.get("train_loss")
        if trainer.is_global_zero and loss is not None:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self._add(self.train_rows, {"step": trainer.global_step, "train_loss": float(loss), "lr": lr})

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


def _point(row: Mapping[str, float]) -> tuple[int, dict[str, float]]:
    return int(row["step"]), {k: float(v) for k, v in row.items() if k != "step"}


def build_trainer(params: TrainParams, work_dir: Path, callbacks: list[L.Callback], logger: Any = False,
                  profiler_dir: Path | None = None, enable_progress_bar: bool = True) -> L.Trainer:
    """A Trainer configured from params; profiler traces go to `profiler_dir` when enabled."""
    profiler: Any = None
    if params.profiler:
        from lightning.pytorch.profilers import PyTorchProfiler

        if profiler_dir is None:
            raise ValueError("train.profiler needs a profiler output directory")
        profiler_dir.mkdir(parents=True, exist_ok=True)
        profiler = PyTorchProfiler(
            dirpath=str(profiler_dir), filename="trace", export_to_chrome=True,
            schedule=torch.profiler.schedule(wait=2, warmup=2, active=5, repeat=1),
        )
    from pipeline.training.checkpoints import AtomicCheckpointIO

    accelerator = "gpu" if params.accelerator == "cuda" else params.accelerator
    strategy: Any = params.strategy
    devices, num_nodes = params.devices, params.num_nodes
    elastic = elastic_world()
    if elastic is not None:  # under torchrun the group's shape is the rendezvous's, which may vary between restarts
        devices, num_nodes = elastic
        strategy = "ddp" if strategy == "auto" else strategy
    if strategy in ("ddp", "ddp_spawn") and not torch.cuda.is_available():
        from lightning.pytorch.strategies import DDPStrategy

        # gloo is the CPU backend; NCCL is picked automatically on CUDA.
        strategy = DDPStrategy(process_group_backend="gloo",
                               start_method="spawn" if params.strategy == "ddp_spawn" else "popen")
    from lightning.pytorch.callbacks import TQDMProgressBar

    if enable_progress_bar:  # tqdm also reports when stderr is a log file, unlike the rich bar
        callbacks = [*callbacks, TQDMProgressBar(refresh_rate=10)]
    lightning_lines_once()
    return L.Trainer(
        max_epochs=params.epochs, accelerator=accelerator, devices=devices, num_nodes=num_nodes,
        strategy=strategy, precision=params.precision, accumulate_grad_batches=params.grad_accum,
        val_check_interval=1.0 / params.val_checks_per_epoch, num_sanity_val_steps=0,
        default_root_dir=str(work_dir), callbacks=callbacks, logger=logger, profiler=profiler,
        enable_progress_bar=enable_progress_bar, use_distributed_sampler=False, log_every_n_steps=10,
        deterministic=False, plugins=[AtomicCheckpointIO()],
    )


def elastic_world() -> tuple[int, int] | None:
    """(processes per machine, machines) when this process is a torchelastic worker (`torchrun`), else None."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    if not TorchElasticEnvironment.detect():
        return None
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return local, max(int(os.environ["WORLD_SIZE"]) // local, 1)
