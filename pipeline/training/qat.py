"""Quantization-aware training's loop: a short Lightning finetune from the FP32 weights with fake quantization
(`pipeline.surgery.fake_quant`), optionally distilled from a frozen copy of the FP32 model, resumable like the
other training jobs; `pipeline.variants.quantize` exports and converts the result like `int8-static`."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.core.params import QuantizeParams
from pipeline.surgery.distill_loss import distillation_loss
from pipeline.surgery.fake_quant import add_fake_quant, remove_fake_quant
from pipeline.training.checkpoints import CheckpointStore, ResumePlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QatResult:
    """What the QAT finetune did."""

    wrapped_layers: int
    steps: int
    samples: int
    final_loss: float


def qat_finetune(model: torch.nn.Module, seqs: Sequence[np.ndarray], labels: Sequence[int],
                 params: QuantizeParams, seed: int = 0, pad_id: int = 0,
                 skip_in_features: int | None = None, store: CheckpointStore | None = None,
                 plan: ResumePlan | None = None) -> QatResult:
    """A short finetune with fake quantization, via Lightning, from the FP32 weights.

    `params` gives the epochs, batch size, learning rate, the INT8 weight format (`weights()`) and
    `qat_distillation`. Layers the INT8 conversion keeps float (`skip_in_features`) train without fake
    quantization. With `qat_distillation` > 0 the loss pulls the fake-quantized model towards a frozen copy of the
    FP32 model's predictions (see `distillation_loss`), so QAT adapts to INT8 rounding instead of drifting on a
    few hundred reviews. With `store` it checkpoints (periodically and on SIGTERM/SIGINT/SIGUSR1) and resumes from
    `plan`'s checkpoint like the other training jobs (`pipeline.training.resume`); the checkpoints go once it ends.
    """
    import copy

    import lightning as L
    from torch.utils.data import DataLoader

    from pipeline.data.batching import Collator, LengthBucketBatchSampler, LoaderPosition, TokenizedDataset
    from pipeline.training.checkpoints import AtomicCheckpointIO
    from pipeline.training.classifier import SentimentClassifier

    teacher = copy.deepcopy(model).eval().requires_grad_(False) if params.qat_distillation > 0 else None
    wrapped = add_fake_quant(model, skip_in_features, params.weights())
    L.seed_everything(seed, verbose=False)
    ds = TokenizedDataset(seqs, labels)
    position = LoaderPosition()
    loader = DataLoader(ds, batch_sampler=LengthBucketBatchSampler(ds.lengths, params.qat_batch_size, seed=seed,
                                                                   position=position),
                        collate_fn=Collator(pad_id=pad_id))
    class _Distilled(SentimentClassifier):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if teacher is None:  # labels only: the plain finetuning step
                return super().training_step(batch, batch_idx)
            logits = self(batch["input_ids"], batch["attention_mask"])
            with torch.no_grad():
                target = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = distillation_loss(logits, target, batch["labels"], params.qat_distillation)
            self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
            return loss

    module = _Distilled(model, lr=params.qat_lr, weight_decay=0.0, warmup_ratio=0.0)
    losses: list[float] = []

    class _Loss(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl: L.LightningModule, out: Any, b: Any, i: int) -> None:
            losses.append(float(out["loss"]))

        def state_dict(self) -> dict[str, Any]:  # a resumed QAT reports the loss of the whole run
            return {"losses": list(losses)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            losses[:] = state_dict["losses"]

    resume = store.callbacks(position) if store is not None else []
    with tempfile.TemporaryDirectory(prefix="qat-") as tmp:
        from lightning.pytorch.callbacks import TQDMProgressBar

        from pipeline.core.stage import lightning_lines_once

        lightning_lines_once()
        trainer = L.Trainer(max_epochs=params.qat_epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=store is not None and store.every_n_steps > 0,
                            default_root_dir=tmp, callbacks=[_Loss(), TQDMProgressBar(refresh_rate=10), *resume],
                            enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=plan.ckpt_path if plan is not None else None)
    if store is not None:
        store.clear()
    remove_fake_quant(model)
    model.eval()
    final = float(np.mean(losses[-10:])) if losses else 0.0
    return QatResult(wrapped, trainer.global_step, len(ds) * params.qat_epochs, final)
