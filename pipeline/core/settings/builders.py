"""Settings sections for the variant builders: `export`, `quantize`, `prune`, `tensorrt`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.core.settings.choices import Auto, CalibrationMethodName, QatPrecision, QuantizeBuild, WeightFormat
from pipeline.core.settings.validation import settings_section

Positive = Annotated[int, Field(ge=1)]


@settings_section("export")
class ExportParams:
    """FP32 TorchScript and ONNX exports and their parity check against PyTorch."""

    opset: int = Field(18, ge=17)
    """the ONNX opset of every graph the pipeline exports: fp32-onnx here, and those the quantize, prune and distill
    stages export to fuse and quantize"""
    parity_samples: int = Field(16, ge=1)
    """real test reviews compared logit by logit with PyTorch"""
    parity_tolerance: float = Field(1e-4, gt=0)
    cls_readout: bool = True
    """The one switch for the [CLS] readout of every exported graph (export, quantize, prune): the last layer
    computes only the position the classifier reads (exact; `pipeline.runtimes.readout`). Models whose head reads
    every position (model.head: mean) are exported whole, with the reason recorded."""
    torchscript: bool = True
    """fp32-torchscript (torch.jit.trace, a deprecated API): built when true, else
    written as a skipped variant with the reason. fp32-onnx is always built: the INT8 variants start from it."""


@settings_section("quantize")
class QuantizeParams:
    """INT8 variants: onnxruntime dynamic/static PTQ and QAT."""

    optimize_graph: bool = True
    """fusions for onnxruntime (attention, SkipLayerNorm, BiasGelu) before dynamic INT8"""
    per_channel: bool = True
    calibration_samples: int = Field(64, ge=1)
    """training reviews for static calibration"""
    calibration_batch_size: int = Field(16, ge=1)
    calibration_methods: list[CalibrationMethodName] = Field(default_factory=lambda: ["percentile"], min_length=1)
    """Each listed method is built and the best on validation reviews kept (a single one skips that pass)."""
    calibration_percentile: float = Field(99.999, gt=50, le=100)
    """the range the percentile calibrator keeps, in percent"""
    selection_samples: int = Field(250, ge=1)
    """validation reviews that choose between calibration methods"""
    qat_train_samples: int = Field(300, ge=1)
    qat_epochs: int = Field(1, ge=1)
    qat_batch_size: int = Field(16, ge=1)
    qat_lr: float = Field(2e-5, ge=0)
    """0 keeps the weights as they are (the QAT loss is still measured)"""
    qat_distillation: float = Field(1.0, ge=0, le=1)
    """Weight of the KL term to the FP32 model's predictions in the QAT loss (0 = plain cross-entropy on labels):
    QAT should learn to reproduce FP32 under INT8 rounding, not keep training on a few hundred reviews."""
    qat_precision: QatPrecision | Auto = "auto"
    """What both QAT finetunes (on the CPU) train in: `32-true`, or `bf16-mixed` (Lightning's bf16 autocast: the
    student's and the FP32 teacher's matrix products in bf16, so the fake-quantized values entering them are
    rounded to bf16's 8 significant bits; weights, optimizer state and loss in fp32). auto: bf16-mixed where the
    CPU has native bf16 (AVX512-BF16/AMX), else 32-true, where bf16 is emulated and slower
    (`pipeline.core.machine.resolve_qat_precision`; the choice is recorded in each QAT variant). Either way the
    variant then runs exact INT8 kernels: only the training's arithmetic differs (docs/variants.md)."""
    qat_openvino_train_samples: int = Field(750, ge=1)
    """training reviews for int8-qat-openvino's QAT (its epochs, batch size and distillation are the qat_ keys'):
    twice as many scored no differently on the test set for twice the training, and int8-qat's smaller count (at
    its lr) moved the test score more than it fixed rounding (how it was chosen: docs/variants.md,
    docs/tried-and-dropped.md)"""
    qat_openvino_lr: float = Field(1e-5, ge=0)
    """int8-qat-openvino's learning rate (0 keeps NNCF's post-training weights and ranges)"""
    ffn_output_dynamic: bool = True
    """Static/QAT quantize each FFN down-projection per batch instead of with a calibrated range: its GELU input has
    outliers that one fixed per-tensor uint8 range handles badly."""
    weight_format: WeightFormat | Auto = "auto"
    """INT8 weight format: s8 signed 8-bit, s7 signed 7-bit (onnxruntime's `reduce_range`), u8 unsigned 8-bit with a
    zero point. On CPUs without VNNI/AMX onnxruntime's U8S8 kernels (AVX2 vpmaddubsw) saturate int16 pair sums, so s8
    gives wrong products there; s7 and u8 are exact. auto: s8 with VNNI/AMX, else u8
    (`pipeline.core.machine.resolve_weight_format`; the choice is recorded in each variant)."""
    build: list[QuantizeBuild] = Field(
        default_factory=lambda: ["int8-dynamic", "int8-openvino", "int8-static", "int8-qat", "int8-qat-openvino"])
    """The quantize stage's variants to build; the others are written as skipped with the reason. The default profile
    builds all five (PTQ dynamic, OpenVINO INT8, PTQ static, QAT for onnxruntime, QAT through NNCF for OpenVINO); a
    profile may leave some out for speed."""

    def weights(self) -> str:
        """`weight_format` once the stage has resolved `auto` (`ResolvedAuto.weight_format`, put in place with
        `dataclasses.replace`); a builder handed an unresolved `auto` is a bug, not a machine to guess about."""
        if self.weight_format == "auto":
            raise ValueError("quantize.weight_format is still 'auto': the stage resolves it once "
                             "(pipeline.core.settings.auto.resolve_auto) and passes the choice down")
        return str(self.weight_format)

    def trainer_precision(self) -> QatPrecision:
        """`qat_precision` once the stage has resolved `auto` (`ResolvedAuto.qat_precision`), as `weights()`."""
        if self.qat_precision == "auto":
            raise ValueError("quantize.qat_precision is still 'auto': the stage resolves it once "
                             "(pipeline.core.settings.auto.resolve_auto) and passes the choice down")
        return self.qat_precision


@settings_section("prune")
class PruneParams:
    """`int8-pruned`: whole heads and FFN neurons removed with least-squares repair, then dynamic INT8.

    Quantization alone is bounded by the CPU's INT8 kernels; pruning removes FLOPs. `null` keeps a dimension
    whole; `enabled: false` records the variant as skipped."""

    enabled: bool = False
    """off in the default profile (its time budget); on in the cpu-long profile"""
    heads: Positive | None = 8
    """attention heads kept per layer (of the model's num_attention_heads)"""
    ffn_width: Positive | None = 768
    """FFN neurons kept per layer (of intermediate_size)"""
    calibration_samples: int = Field(256, ge=1)
    """training reviews whose activations drive selection and repair"""
    calibration_batch_size: int = Field(16, ge=1)
    damp: float = Field(0.001, gt=0, lt=1)
    """ridge, relative to the mean diagonal of the Gram matrix"""


@settings_section("tensorrt")
class TensorRTParams:
    """TensorRT optimisation profile and workspace (used only where CUDA and tensorrt exist).

    The longest sequence of the profile is the model's own `data.max_length`, read from its record; `opt_seq` above
    it is cut to it. Shapes must grow: min_batch <= opt_batch <= max_batch, min_seq <= opt_seq."""

    min_batch: int = Field(1, ge=1)
    opt_batch: int = Field(8, ge=1)
    max_batch: int = Field(64, ge=1)
    min_seq: int = Field(8, ge=1)
    opt_seq: int = Field(128, ge=1)
    workspace_mb: int = Field(2048, ge=1)
    qdq_input: bool | Auto = "auto"
    """The INT8 engine's QDQ input (built and scored with onnxruntime): auto builds it only where engines can be built
    (CUDA and `tensorrt` present); true builds it on any machine, e.g. to check its accuracy on a CPU."""

    @model_validator(mode="after")
    def _profile_grows(self) -> TensorRTParams:
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(f"opt_batch: must lie in [min_batch, max_batch] = [{self.min_batch}, {self.max_batch}], "
                             f"got {self.opt_batch}")
        if self.min_seq > self.opt_seq:
            raise ValueError(f"min_seq: must be at most opt_seq ({self.opt_seq}), got {self.min_seq}")
        return self
