"""Quantization-aware training's loop: a short Lightning finetune from the FP32 weights with fake quantization,
optionally distilled from a frozen copy of the FP32 model, resumable like the other training jobs. `int8-qat`'s
fake quantizers are `pipeline.surgery.fake_quant`'s (onnxruntime's scheme; `pipeline.variants.onnx_qat` exports and
converts the result like `int8-static`); `int8-qat-openvino`'s are NNCF's (`pipeline.variants.openvino_qat`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.machine import training_attention
from pipeline.core.params import QuantizeParams, TrainParams
from pipeline.surgery.distill_loss import distillation_loss
from pipeline.surgery.fake_quant import add_fake_quant, remove_fake_quant
from pipeline.training.checkpoints import CheckpointStore, ResumePlan
from pipeline.training.fingerprint import fingerprint
from pipeline.training.loop import fit, seed_run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QatResult:
    """What the QAT finetune did."""

    wrapped_layers: int
    steps: int
    final_loss: float


@dataclass(frozen=True, kw_only=True)
class QatRun:
    """One QAT finetune's reviews and settings: `params`' epochs, batch size, `qat_distillation` and resolved
    `qat_precision` (and, for int8-qat, the weight format), the job's own learning rate, where it checkpoints
    (`store`, None: nowhere) and whether it resumes (`plan`, from `qat_checkpoints`)."""

    reviews: Sequence[np.ndarray]  # token ids, in the training window
    labels: Sequence[int] | np.ndarray
    params: QuantizeParams
    lr: float
    seed: int = 0
    pad_id: int = 0
    store: CheckpointStore | None = None
    plan: ResumePlan | None = None

    def record(self, steps: int, final_loss: float) -> dict[str, Any]:
        """The `qat_*` keys both QAT variants record (what was trained, how, and whether it resumed)."""
        q = self.params
        return {"qat_samples": len(self.reviews) * q.qat_epochs, "qat_steps": steps, "qat_epochs": q.qat_epochs,
                "qat_max_length": max(len(r) for r in self.reviews), "qat_lr": self.lr,
                "qat_distillation": q.qat_distillation, "qat_precision": q.trainer_precision(),
                "qat_final_loss": round(final_loss, 4),
                **{f"qat_{k}": v for k, v in (self.plan.record() if self.plan else {}).items()}}


def qat_checkpoints(train: TrainParams, job: str, settings: Mapping[str, Any], model: torch.nn.Module,
                    inputs: Sequence[Path], code: Sequence[Path],
                    quantize: QuantizeParams) -> tuple[CheckpointStore, ResumePlan]:
    """The checkpoint store of QAT `job` (`train.checkpoint_dir/<job>`) and whether it resumes. A checkpoint is
    resumed only for the same trajectory: the same `settings` (what the builder says shapes the weights: its
    QAT settings, reviews and labels, calibration), seed, attention kernel (`training_attention` of the Trainer QAT
    runs in, `qat_train_params(quantize, ...)`, as `fit` derives it; not the finetune's `train`), model structure
    (the parameter names and shapes of the `model` about to train: a checkpoint of another graph would not load),
    `inputs` (the finetuned model) and code (the training code and the builder's own modules, `code`). Settings
    the job does not read (another variant's, `quantize.build`) leave a checkpoint valid. The caller clears the
    store once its variant is published."""
    store = CheckpointStore.for_job(train, job)
    import hashlib
    import json

    shapes = sorted((name, list(t.shape)) for name, t in model.state_dict().items())
    # a digest, not the list: the reason a fresh start gives names what changed in one short line
    structure = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    trainer = qat_train_params(quantize, train.seed)
    attention = training_attention(trainer.precision, trainer.accelerator).value
    current = fingerprint({**settings, "seed": train.seed, "structure": structure, "attention": attention}, inputs,
                          code=code)
    return store, store.plan(current, train.resume)


#: The Trainer QAT runs in, whatever `train:` asks of the finetune (a GPU, DDP, several nodes, accumulation, the
#: profiler): one process on the CPU, where the INT8 variants it feeds are built and timed, in the threads the stage
#: already runs with. With the epochs, precision and seed these are every field `build_trainer` and `seed_run` read,
#: named here so none falls back to a default unseen.
QAT_TRAINER: Mapping[str, Any] = {"accelerator": "cpu", "strategy": "auto", "devices": 1, "num_nodes": 1,
                                  "grad_accum": 1, "val_checks_per_epoch": 1, "profiler": False, "threads": None}


def qat_train_params(params: QuantizeParams, seed: int) -> TrainParams:
    """The Trainer's settings for QAT: `quantize.qat_epochs` in the resolved `quantize.qat_precision` in
    `QAT_TRAINER`'s one CPU process (the learning rate, batch size and loss are QAT's own, given to the module and
    loader)."""
    return TrainParams(epochs=params.qat_epochs, precision=params.trainer_precision(), seed=seed, **QAT_TRAINER)


def qat_finetune(model: torch.nn.Module, run: QatRun, skip_in_features: int | None = None) -> QatResult:
    """A short finetune with fake quantization, via Lightning, from the FP32 weights (`int8-qat`).

    `run.params` gives the epochs, batch size, the INT8 weight format (`weights()`) and `qat_distillation`. Layers
    the INT8 conversion keeps float (`skip_in_features`) train without fake quantization. With `qat_distillation` >
    0 the loss pulls the fake-quantized model towards a frozen copy of the FP32 model's predictions (see
    `distillation_loss`), so QAT adapts to INT8 rounding instead of drifting on a few hundred reviews. With
    `run.store` it checkpoints (periodically and on SIGTERM/SIGINT/SIGUSR1) and resumes from `run.plan`'s
    checkpoint like the other training jobs (`pipeline.training.resume`); the checkpoints stay until the caller
    has published the variant (`CheckpointStore.clear`).
    """
    import copy

    teacher = copy.deepcopy(model).eval().requires_grad_(False) if run.params.qat_distillation > 0 else None
    wrapped = add_fake_quant(model, skip_in_features, run.params.weights())
    steps, loss = _distilled_finetune(model, teacher, run)
    remove_fake_quant(model)
    model.eval()
    return QatResult(wrapped, steps, loss)


def fake_quantized_finetune(model: torch.nn.Module, teacher: torch.nn.Module | None, run: QatRun) -> tuple[int, float]:
    """The same finetune on a model whose fake quantizers are already in place (`int8-qat-openvino`: NNCF's, put
    there by `nncf.quantize`), distilled from `teacher` (the FP32 model, frozen; None: labels only). Both models
    take `input_ids` and `attention_mask` and return logits (or an output with `.logits`). Returns the steps taken
    and the final loss; the model is left in eval mode."""
    steps, loss = _distilled_finetune(model, teacher, run)
    model.eval()
    return steps, loss


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _distilled_finetune(model: torch.nn.Module, teacher: torch.nn.Module | None, run: QatRun) -> tuple[int, float]:
    """QAT's Lightning loop: `qat_epochs` over `run.reviews` in length buckets of `qat_batch_size`, the loss
    `distillation_loss` towards `teacher` (cross-entropy alone without one), no validation (the last weights are
    QAT's), checkpointed to `run.store` and resumed from `run.plan`. Returns the steps and the final loss of the
    whole run, a resumed one's included (the curves travel in every checkpoint)."""
    from torch.utils.data import DataLoader

    from pipeline.data.batching import Collator, LengthBucketBatchSampler, LoaderPosition, TokenizedDataset
    from pipeline.training.classifier import OptimisationRecipe, SentimentClassifier

    params = run.params
    train = qat_train_params(params, run.seed)
    seed_run(train)
    ds = TokenizedDataset(run.reviews, run.labels)
    position = LoaderPosition()
    loader = DataLoader(ds, batch_sampler=LengthBucketBatchSampler(ds.lengths, params.qat_batch_size, seed=run.seed,
                                                                   position=position),
                        collate_fn=Collator(pad_id=run.pad_id))

    class _Distilled(SentimentClassifier):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return _logits(self.model(input_ids=input_ids, attention_mask=attention_mask))

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if teacher is None:  # labels only: the plain finetuning step
                return super().training_step(batch, batch_idx)
            logits = self(batch["input_ids"], batch["attention_mask"])
            with torch.no_grad():
                target = _logits(teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
            loss = distillation_loss(logits, target, batch["labels"], params.qat_distillation)
            self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
            return loss

    module = _Distilled(model, OptimisationRecipe(lr=run.lr))  # no weight decay, no warm-up: a short adaptation
    fitted = fit(module, train, store=run.store, plan=run.plan, position=position, loader=loader, keep_best=False,
                 model_summary=False)
    return fitted.steps, fitted.curves.final_loss(10)
