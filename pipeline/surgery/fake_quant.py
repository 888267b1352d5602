"""QAT's fake quantizers: every `nn.Linear` (but the FFN down-projections when they are quantized per batch) gets
fake-quantized inputs and weights on onnxruntime's INT8 grids, wrapped in and out of a model in place; the short
finetune that learns INT8 rounding with them is `pipeline.training.qat`.

The fake quantizers are torchao's (`torchao.quantization.pt2e.FakeQuantize` with its moving-average per-tensor
and per-channel min/max observers: the modules torchao's PT2E QAT inserts, maintained there since
`torch.ao.quantization` was deprecated). They reproduce what onnxruntime's QDQ conversion does to the same
tensors: uint8 asymmetric per-tensor activations and per-channel weights on the grid onnxruntime's static QDQ
conversion (`WeightSymmetric`, `pipeline.variants.calibration`) puts them on for the `quantize.weight_format`: int8
symmetric +-127 (`s8`) or +-64 (`s7`, onnxruntime's `reduce_range`), scale max |w| / 127 or / 64; uint8 0..255
symmetric about zero point 128 (`u8`), scale max |w| / 127.5.

torchao's eager QAT API (`QATConfig` with `IntxFakeQuantizeConfig`, i.e. `FakeQuantizedLinear`) cannot express
that, which is why it is not used here:
- activations: its granularities are per token, per axis or per group; `PerTensor()` is refused
  (`ValueError: Granularity 'PerTensor()' is not supported`), while onnxruntime's static QDQ quantizes each
  activation with one calibrated range per tensor;
- weights: its symmetric grids are [-128, 127] (int8) and [-64, 63] (int7) with scale max |w| / 127.5 and
  / 63.5; onnxruntime's are +-127 and +-64 with max |w| / 127 and / 64, so QAT would learn to round onto a grid
  0.4-0.8 % off the one the weights are converted to (of 256 random weights, 35 (int8) and 50 (int7) come
  out of its fake quantization on another level than onnxruntime quantizes them to).
These fake quantizers give an int8-qat file identical, weight for weight, to the torch.ao build they replace;
`QATConfig` with per-token int8 activations and per-channel int8 weights made no measurable difference and reaches
`torch.ao` internals through its per-token path (`torch.ao.quantization.fx._decomposed`): the measurements are in
docs/tried-and-dropped.md.
PT2E QAT proper (`prepare_qat_pt2e`) trains a `torch.export` graph instead of the HF model that the Lightning
loop, the distillation teacher and the [CLS]-readout export work on; the wrapper below applies the same
torchao fake quantizers to the HF model's Linear layers in place.
"""

from __future__ import annotations

from typing import Any

import torch

# What did the fake quantization, as recorded in the int8-qat variant's record.
FAKE_QUANT_API = "torchao.quantization.pt2e.FakeQuantize"


def weight_grid(weight_format: str) -> dict[str, Any]:
    """The weight `FakeQuantize` arguments for onnxruntime's symmetric per-channel grid in a `quantize.weight_format`:
    [-127, 127] (`s8`), [-64, 64] (`s7`), or [0, 255] about zero point 128 (`u8`). For `u8` the range is left
    to the observer: an explicit [0, 255] makes torchao's symmetric zero point the rounded-down midpoint 127,
    while its own quint8 range gives 128, the zero point onnxruntime converts symmetric uint8 weights with."""
    if weight_format == "u8":
        return {"dtype": torch.quint8, "qscheme": torch.per_channel_symmetric}
    if weight_format in ("s8", "s7"):
        qmax = 64 if weight_format == "s7" else 127
        return {"quant_min": -qmax, "quant_max": qmax, "dtype": torch.qint8, "qscheme": torch.per_channel_symmetric}
    raise ValueError(f"unknown INT8 weight format {weight_format!r}")


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
        self.weight_fq = FakeQuantize(observer=PerChannelMinMaxObserver, ch_axis=0, **weight_grid(weight_format))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.input_fq(x), self.weight_fq(self.linear.weight), self.linear.bias)


def add_fake_quant(model: torch.nn.Module, skip_in_features: int | None = None, weight_format: str = "s8") -> int:
    """Wrap every Linear in place (except those with `skip_in_features` inputs, kept float); returns the count.

    The classification head is fake-quantized too, although the exported INT8 graphs run it in float
    (`pipeline.variants.onnx_census.head_matmuls`): QAT without the head's quantizers scored lower on the default
    run (docs/weight-formats.md), while serving a head trained with them in float only takes its rounding away."""
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
