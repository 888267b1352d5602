"""Every model variant the pipeline knows, in one typed table.

The build stages (export, quantize, prune, tensorrt) write the variants the table assigns to them; evaluate,
benchmark, package, the report and the tests read the same table, so nothing guesses a variant's kind from its
name. A variant's directory is `<variants root>/<name>` (`models/variants` in dvc.yaml); `fp32-eager` is the
finetuned model itself and `fp32-eager-bf16` the same weights measured under bf16 autocast (`fp32-eager-readout`,
`fp32-eager-mkl`: the same weights timed another way, `TIMING_ROWS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Format = Literal["eager", "torchscript", "onnx", "openvino", "tensorrt"]
Precision = Literal["float32", "bfloat16", "float16", "int8"]
#: fp32: the finetuned weights in another runtime; int8: quantization alone; pruned: fewer heads/neurons + INT8;
#: distilled: the smaller student model (FP32 or INT8); tensorrt: GPU engines.
Family = Literal["fp32", "int8", "pruned", "distilled", "tensorrt"]
Stage = Literal["finetune", "export", "quantize", "prune", "distill", "tensorrt", "benchmark"]


class UnknownVariant(KeyError):
    """A variant name that is not in the registry."""


@dataclass(frozen=True)
class VariantSpec:
    """One row of the registry."""

    name: str
    format: Format
    precision: Precision
    family: Family
    stage: Stage  # the DVC stage that builds it
    file: str | None  # the model file inside the variant directory (None: the finetuned HF directory)
    description: str

    @property
    def has_directory(self) -> bool:
        """Built into a directory of its own under the variants root (every row but the eager reference rows)."""
        return self.format != "eager"

    @property
    def servable(self) -> bool:
        """The serving handler can run it on CPU, so the package stage may choose it."""
        return self.format in ("torchscript", "onnx", "openvino")

    @property
    def quantized(self) -> bool:
        return self.precision == "int8"

    @property
    def cpu_int8(self) -> bool:
        """An INT8 variant served on CPU: the ones the accuracy/speed-up targets and the package choice weigh."""
        return self.quantized and self.servable


REFERENCE = "fp32-eager"
BF16_ROW = "fp32-eager-bf16"
READOUT_ROW = "fp32-eager-readout"
MKL_ROW = "fp32-eager-mkl"
#: Rows that time the reference's own weights another way: no accuracy, file or MLflow model of their own.
TIMING_ROWS = (BF16_ROW, READOUT_ROW, MKL_ROW)

VARIANTS: tuple[VariantSpec, ...] = (
    VariantSpec(REFERENCE, "eager", "float32", "fp32", "finetune", None,
                "the finetuned PyTorch model: the reference every variant is compared with"),
    VariantSpec(BF16_ROW, "eager", "bfloat16", "fp32", "benchmark", None,
                "the finetuned model under bf16 autocast (benchmark row only)"),
    VariantSpec(READOUT_ROW, "eager", "float32", "fp32", "benchmark", None,
                "the finetuned model with the [CLS] readout, eager (benchmark row: the readout's share of speed-up)"),
    VariantSpec(MKL_ROW, "eager", "float32", "fp32", "benchmark", None,
                "the finetuned model with PyTorch's own FP32 products (MKL), where fp32-eager runs oneDNN's "
                "(benchmark row: what the kernel choice changes)"),
    VariantSpec("fp32-torchscript", "torchscript", "float32", "fp32", "export", "model.pt",
                "traced TorchScript, frozen and optimised at load"),
    VariantSpec("fp32-onnx", "onnx", "float32", "fp32", "export", "model.onnx",
                "ONNX from the torch.export-based exporter"),
    VariantSpec("int8-dynamic", "onnx", "int8", "int8", "quantize", "model.onnx",
                "onnxruntime-fused graph, dynamic INT8 (per-batch activation ranges)"),
    VariantSpec("int8-static", "onnx", "int8", "int8", "quantize", "model.onnx",
                "QDQ static INT8 with calibrated activation ranges"),
    VariantSpec("int8-qat", "onnx", "int8", "int8", "quantize", "model.onnx",
                "quantization-aware finetune, then the same QDQ conversion as int8-static"),
    VariantSpec("int8-openvino", "openvino", "int8", "int8", "quantize", "model.xml",
                "OpenVINO IR of the exported graph (torch.export), NNCF post-training INT8 (static activation scales)"),
    VariantSpec("int8-qat-openvino", "openvino", "int8", "int8", "quantize", "model.xml",
                "quantization-aware finetune through NNCF's quantizers (int8-openvino's scheme), then OpenVINO IR"),
    VariantSpec("int8-pruned", "onnx", "int8", "pruned", "prune", "model.onnx",
                "fewer attention heads and FFN neurons (least-squares repaired), then dynamic INT8"),
    VariantSpec("fp32-distilled", "onnx", "float32", "distilled", "distill", "model.onnx",
                "the distilled student (fewer layers, trained on the teacher's predictions), FP32 ONNX"),
    VariantSpec("int8-distilled", "onnx", "int8", "distilled", "distill", "model.onnx",
                "the distilled student through int8-dynamic's recipe (fused graph, dynamic INT8)"),
    VariantSpec("int8-distilled-openvino", "openvino", "int8", "distilled", "distill", "model.xml",
                "the distilled student through int8-openvino's recipe (torch.export, NNCF static INT8)"),
    VariantSpec("tensorrt-fp16", "tensorrt", "float16", "tensorrt", "tensorrt", "model.engine",
                "TensorRT FP16 engine (CUDA only)"),
    VariantSpec("tensorrt-int8", "tensorrt", "int8", "tensorrt", "tensorrt", "model.engine",
                "TensorRT INT8 engine from a QDQ model (CUDA only)"),
)

_BY_NAME = {v.name: v for v in VARIANTS}


def spec(name: str) -> VariantSpec:
    """The registry row of `name`; an unknown name fails with the known ones listed."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownVariant(f"unknown variant {name!r}; known: {', '.join(_BY_NAME)}") from None


def built_by(stage: Stage) -> tuple[VariantSpec, ...]:
    """The variants one stage writes, in table order."""
    return tuple(v for v in VARIANTS if v.stage == stage and v.has_directory)


def with_directories() -> tuple[VariantSpec, ...]:
    """Every variant that lives in a directory under the variants root, in table order."""
    return tuple(v for v in VARIANTS if v.has_directory)


def directories(root: Path, specs: tuple[VariantSpec, ...] | None = None) -> dict[str, Path]:
    """Variant name -> its directory under `root` (all variants with a directory unless `specs` is given)."""
    return {v.name: root / v.name for v in (with_directories() if specs is None else specs)}
