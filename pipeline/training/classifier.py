"""Accelerated finetuning with Lightning: the module, the data module and the optimizer (the Trainer they run in
is `pipeline.training.loop`'s).

Accelerations are params (`TrainParams`): mixed precision, `torch.compile`, length-bucketed batches with
dynamic padding, gradient accumulation, DataLoader workers, the torch profiler, and DDP/FSDP/DeepSpeed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAccuracy

from pipeline.core.errors import UserError
from pipeline.core.params import TrainParams
from pipeline.core.settings.choices import CompileMode
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


@dataclass(frozen=True)
class OptimisationRecipe:
    """How `SentimentClassifier` trains: AdamW's learning rate and weight decay, the linear warm-up's share of the
    steps, and the accelerations of its forward and optimizer step. `of` reads them from one `TrainParams`, so
    every job that trains from `train:` (finetune, distill, the benchmarks) gets all of them, none forgotten."""

    lr: float
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    compile_model: bool = False
    compile_mode: CompileMode = "default"
    fused_optimizer: bool = True
    gradient_checkpointing: bool = False

    @classmethod
    def of(cls, params: TrainParams, *, lr: float | None = None) -> OptimisationRecipe:
        """`params`' recipe, with `lr` for a job with its own learning rate (distill's)."""
        return cls(lr=params.lr if lr is None else lr, weight_decay=params.weight_decay,
                   warmup_ratio=params.warmup_ratio, compile_model=params.compile, compile_mode=params.compile_mode,
                   fused_optimizer=params.fused_optimizer, gradient_checkpointing=params.gradient_checkpointing)


class SentimentClassifier(L.LightningModule):
    """A Hugging Face sequence classifier trained with AdamW and linear warm-up/decay, as `recipe` says."""

    def __init__(self, model: torch.nn.Module, recipe: OptimisationRecipe) -> None:
        super().__init__()
        self.model = model.train()  # from_pretrained returns eval mode; training wants dropout on
        if recipe.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.recipe = recipe
        self._forward_fn: Any = None  # compiled callable kept off the module tree so checkpoints stay plain
        self.val_acc = BinaryAccuracy()

    def _fn(self) -> Any:
        if self._forward_fn is None:
            r = self.recipe
            fn = torch.compile(self.model, mode=r.compile_mode, dynamic=True) if r.compile_model else self.model
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

        r = self.recipe
        optimizer = build_optimizer(self.model, r.lr, r.weight_decay, fused=r.fused_optimizer)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = get_linear_schedule_with_warmup(optimizer, int(r.warmup_ratio * total), total)
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
