"""The closed sets of allowed setting values, defined once: the schema's fields use these `Literal` types and the
code that acts on a value imports the same names (its tuple of values is `typing.get_args` of the type)."""

from __future__ import annotations

from typing import Literal, get_args

Auto = Literal["auto"]

DataSource = Literal["hub", "parquet", "aclimdb"]
Truncation = Literal["head", "head_tail"]
ModelSource = Literal["packaged", "hub", "local", "tiny"]
Head = Literal["cls", "mean"]

#: Lightning precisions the trainer accepts (`train.precision`, `auto` resolved by `resolve_auto`).
Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
#: What QAT's CPU finetunes train in (`quantize.qat_precision`): fp32, or matrix products in bf16 under autocast.
QatPrecision = Literal["32-true", "bf16-mixed"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
Accelerator = Literal["auto", "cpu", "gpu", "cuda"]
Strategy = Literal["auto", "ddp", "ddp_spawn", "fsdp", "deepspeed"]
Launcher = Literal["none", "torchrun"]

#: What the distill stage's teacher reads when it labels a review (`distill.teacher_reads`).
TeacherReads = Literal["window", "review"]

#: onnxruntime static-calibration methods (`quantize.calibration_methods`).
CalibrationMethodName = Literal["minmax", "percentile", "entropy"]
#: INT8 weight formats for onnxruntime's integer kernels (uint8 activations times these weights): `s8` signed 8-bit
#: (U8S8 kernels), `s7` signed 7-bit (onnxruntime's `reduce_range`), `u8` unsigned 8-bit with a zero point (U8U8
#: kernels).
WeightFormat = Literal["s8", "s7", "u8"]

#: The quantize stage's variants (`quantize.build`).
QuantizeBuild = Literal["int8-dynamic", "int8-static", "int8-qat", "int8-openvino", "int8-qat-openvino"]

#: Which variant `package.variant: auto` serves among those within the accuracy window.
Prefer = Literal["accuracy", "speed"]

TEACHER_READS: tuple[str, ...] = get_args(TeacherReads)
CALIBRATION_METHODS: tuple[str, ...] = get_args(CalibrationMethodName)
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
