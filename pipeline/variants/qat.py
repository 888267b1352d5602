"""Quantization-aware training: every `nn.Linear` (but the FFN down-projections when they are quantized per
batch) gets fake-quantized inputs and weights, and a short finetune distilled from the FP32 model learns INT8
rounding; the result is exported and converted like `int8-static`.

The fake quantizers are torchao's (`torchao.quantization.pt2e.FakeQuantize` with its moving-average per-tensor
and per-channel min/max observers: the modules torchao's PT2E QAT inserts, maintained there since
`torch.ao.quantization` was deprecated). They reproduce what onnxruntime's QDQ conversion does to the same
tensors: uint8 asymmetric per-tensor activations and per-channel weights on onnxruntime's grid for the
`quantize.weight_format`: int8 symmetric +-127 (`s8`) or +-64 (`s7`, onnxruntime's `reduce_range`), scale
max |w| / 127 or / 64; uint8 asymmetric 0..255 (`u8`), scale (max(w, 0) - min(w, 0)) / 255 with a zero point.

torchao's eager QAT API (`QATConfig` with `IntxFakeQuantizeConfig`, i.e. `FakeQuantizedLinear`) cannot express
that, which is why it is not used here:
- activations: its granularities are per token, per axis or per group; `PerTensor()` is refused
  (`ValueError: Granularity 'PerTensor()' is not supported`), while onnxruntime's static QDQ quantizes each
  activation with one calibrated range per tensor;
- weights: its symmetric grids are [-128, 127] (int8) and [-64, 63] (int7) with scale max |w| / 127.5 and
  / 63.5; onnxruntime's are +-127 and +-64 with max |w| / 127 and / 64, so QAT would learn to round onto a grid
  0.4-0.8 % off the one the weights are converted to (of 256 random weights, 35 (int8) and 50 (int7) come
  out of its fake quantization on another level than onnxruntime quantizes them to).
Measured on the default profile's model (3,000 unseen train-split reviews, `benchmarks.heldout_accuracy`'s
sample): these fake quantizers give an int8-qat file identical, weight for weight, to the torch.ao build they
replace (89.97 %); `QATConfig` with per-token int8 activations and per-channel int8 weights, converted the
same way, gave 90.13 % (+0.17 +- 0.17 pt paired: no measurable difference) and reaches `torch.ao` internals
through its per-token path (`torch.ao.quantization.fx._decomposed`).
PT2E QAT proper (`prepare_qat_pt2e`) trains a `torch.export` graph instead of the HF model that the Lightning
loop, the distillation teacher and the [CLS]-readout export work on; the wrapper below applies the same
torchao fake quantizers to the HF model's Linear layers in place.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.core.params import QuantizeParams
from pipeline.training.distill import distillation_loss
from pipeline.training.resume import CheckpointStore, ResumePlan

log = logging.getLogger(__name__)

# What did the fake quantization, as recorded in the int8-qat variant's record.
FAKE_QUANT_API = "torchao.quantization.pt2e.FakeQuantize"


def weight_grid(weight_format: str) -> tuple[int, int, torch.dtype, torch.qscheme]:
    """onnxruntime's weight grid for a `quantize.weight_format`: (quant_min, quant_max, dtype, qscheme), each per
    output channel: [-127, 127] symmetric (`s8`), [-64, 64] symmetric (`s7`), [0, 255] with a zero point (`u8`)."""
    if weight_format == "u8":
        return 0, 255, torch.quint8, torch.per_channel_affine
    if weight_format in ("s8", "s7"):
        qmax = 64 if weight_format == "s7" else 127
        return -qmax, qmax, torch.qint8, torch.per_channel_symmetric
    raise ValueError(f"unknown INT8 weight format {weight_format!r}")


# ---------------------------------------------------------------------------------------- QAT
class FakeQuantLinear(torch.nn.Module):
    """`nn.Linear` whose input and weight are fake-quantized as onnxruntime's QDQ MatMul will quantize them:
    the input per tensor to uint8 with a moving-average min/max range (the calibrated range of the
    conversion), the weight per output channel on the `weight_format`'s grid (`weight_grid`)."""

    def __init__(self, linear: torch.nn.Linear, weight_format: str = "s8") -> None:
        super().__init__()
        from torchao.quantization.pt2e import FakeQuantize, MovingAverageMinMaxObserver, PerChannelMinMaxObserver

        self.linear = linear
        self.input_fq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                     dtype=torch.quint8, qscheme=torch.per_tensor_affine)
        qmin, qmax, dtype, qscheme = weight_grid(weight_format)
        self.weight_fq = FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=qmin, quant_max=qmax,
                                      dtype=dtype, qscheme=qscheme, ch_axis=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.input_fq(x), self.weight_fq(self.linear.weight), self.linear.bias)


def add_fake_quant(model: torch.nn.Module, skip_in_features: int | None = None, weight_format: str = "s8") -> int:
    """Wrap every Linear in place (except those with `skip_in_features` inputs, kept float); returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.in_features != skip_in_features:
                setattr(parent, name, FakeQuantLinear(child, weight_format))
                count += 1
    return count


def remove_fake_quant(model: torch.nn.Module) -> int:
    """Put the (QAT-adapted) plain Linear layers back; returns how many were unwrapped."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FakeQuantLinear):
                setattr(parent, name, child.linear)
                count += 1
    return count


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
    from pipeline.training.classifier import SentimentClassifier
    from pipeline.training.resume import AtomicCheckpointIO

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
