"""onnxruntime INT8 quantization: dynamic and static (QDQ, calibrated) models, the per-batch FFN down-projections,
and the check that a build quantized its matrix products (`int8_census`). Calibration data is
`pipeline.variants.calibration`, the graph census `pipeline.variants.onnx_census`, TensorRT's QDQ input
`pipeline.variants.tensorrt_qdq`."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.errors import UserError
from pipeline.core.machine import WEIGHT_FORMATS
from pipeline.core.params import QuantizeParams
from pipeline.variants.calibration import CALIBRATION_METHODS, TokenCalibrationReader, calibration_options
from pipeline.variants.onnx_census import activation_matmuls, ffn_output_matmuls, matmul_census

if TYPE_CHECKING:
    from pipeline.core.machine import Choice

log = logging.getLogger(__name__)


class QuantizeError(UserError):
    """A quantized variant could not be built."""


def _without_value_info(src: Path, dst: Path) -> Path:
    """A copy without intermediate shapes: the exporter's example-batch shapes contradict the dynamic axes
    once the dynamic quantizer re-runs shape inference."""
    import onnx

    model = onnx.load(str(src))
    del model.graph.value_info[:]
    onnx.save(model, str(dst))
    return dst


def weight_options(weight_format: str) -> dict[str, Any]:
    """onnxruntime quantizer arguments for a `quantize.weight_format` (resolved, see
    `pipeline.core.machine.WEIGHT_FORMATS`): `s8`/`s7` are int8 (7-bit through `reduce_range`), `u8` uint8."""
    from onnxruntime.quantization import QuantType

    if weight_format not in WEIGHT_FORMATS:
        raise QuantizeError(f"unknown INT8 weight format {weight_format!r}; use one of {WEIGHT_FORMATS}")
    return {"weight_type": QuantType.QUInt8 if weight_format == "u8" else QuantType.QInt8,
            "reduce_range": weight_format == "s7"}


def quantize_dynamic_onnx(src: Path, dst: Path, per_channel: bool = True, weight_format: str = "s8") -> None:
    """Weights to INT8 (`weight_format`) ahead of time, activations quantized on the fly per batch."""
    import onnx
    from onnxruntime.quantization import quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="dynq-") as tmp:
        clean = _without_value_info(src, Path(tmp) / "clean.onnx")
        # Fused contrib ops (SkipLayerNormalization, BiasGelu) have no ONNX shape inference: default to float.
        quantize_dynamic(str(clean), str(dst), per_channel=per_channel, **weight_options(weight_format),
                         op_types_to_quantize=["MatMul", "Gemm", "Attention", "Gather"],
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def quantize_static_onnx(src: Path, dst: Path, calibration: Sequence[np.ndarray], method: str,
                         params: QuantizeParams, pad_id: int = 0, dynamic_ffn_output_of: int | None = None) -> None:
    """One static QDQ INT8 model (see `quantize_static_onnx_methods`)."""
    quantize_static_onnx_methods(src, {method: dst}, calibration, params, pad_id, dynamic_ffn_output_of)


def quantize_static_onnx_methods(src: Path, dsts: dict[str, Path], calibration: Sequence[np.ndarray],
                                 params: QuantizeParams, pad_id: int = 0,
                                 dynamic_ffn_output_of: int | None = None) -> None:
    """QDQ static INT8, one model per calibration method in `dsts`: uint8 activations with calibrated ranges,
    per-channel weights in the format `params.weights()` resolves to (see `QuantizeParams.weight_format`).

    Matrix products with a weight operand are quantized; the two activation-only products of each attention
    layer stay float (see `activation_matmuls`).

    Only MatMul/Gemm (compute) and Gather (the embedding table, most of the file) are quantized:
    quantizing Add/LayerNorm/Softmax costs BERT accuracy for little speed. With `dynamic_ffn_output_of` set to
    the FFN width, the FFN down-projections are left out of calibration (see `ffn_output_matmuls`) and
    quantized dynamically instead (`dynamic_int8_matmuls`). Pre-processing and that dynamic pass do not depend
    on the calibration method, so they run once for all methods.
    """
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    unknown = [m for m in dsts if m not in CALIBRATION_METHODS]
    if unknown:
        raise QuantizeError(f"unknown calibration method {unknown[0]!r}; use one of {CALIBRATION_METHODS}")
    with tempfile.TemporaryDirectory(prefix="quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        graph = onnx.load(str(pre), load_external_data=False).graph
        names = {i.name for i in graph.input}
        excluded = activation_matmuls(graph)
        ffn = ffn_output_matmuls(graph, dynamic_ffn_output_of) if dynamic_ffn_output_of else []
        base = pre
        if ffn:  # first, on the float graph: the dynamic quantizer rewrites Gemm as MatMul, QDQ or not
            base = Path(tmp) / "ffn-dynamic.onnx"
            converted = dynamic_int8_matmuls(pre, base, ffn, params.per_channel, params.weights())
            if converted != len(ffn):
                raise QuantizeError(f"only {converted} of {len(ffn)} FFN down-projections were quantized dynamically")
        for method, dst in dsts.items():
            # No symbolic shape inference (it fails on the exporter's graph); ONNX's own inference types every
            # tensor of the unfused graph, which is what the quantizer needs.
            quantize_static(
                str(base), str(dst), TokenCalibrationReader(calibration, params.calibration_batch_size, names,
                                                            pad_id),
                quant_format=QuantFormat.QDQ, per_channel=params.per_channel, activation_type=QuantType.QUInt8,
                **weight_options(params.weights()),
                op_types_to_quantize=["MatMul", "Gemm", "Gather"], nodes_to_exclude=excluded,
                **calibration_options(method, params, activation_symmetric=False),
            )


def dynamic_int8_matmuls(src: Path, dst: Path, node_names: Sequence[str], per_channel: bool = True,
                         weight_format: str = "s8") -> int:
    """onnxruntime's dynamic quantizer on just the MatMuls in `node_names`; returns how many it converted.

    Their inputs (the FFN's GELU output) have outliers that a calibrated per-tensor range handles badly, so
    they are quantized per batch at run time, as `int8-dynamic` does everywhere; the weights are stored INT8
    (per output column, in `weight_format`) so the file stays at a quarter of FP32. onnxruntime fuses
    each resulting `DynamicQuantizeLinear` + `MatMulInteger` + scale chain into one `DynamicQuantizeMatMul`
    when it loads the file.
    """
    import onnx
    from onnxruntime.quantization import quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="dynffn-") as tmp:
        clean = _without_value_info(src, Path(tmp) / "clean.onnx")
        quantize_dynamic(str(clean), str(dst), per_channel=per_channel, **weight_options(weight_format),
                         op_types_to_quantize=["MatMul"], nodes_to_quantize=list(node_names),
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True})
    wanted = {f"{name}_quant" for name in node_names}
    graph = onnx.load(str(dst), load_external_data=False).graph
    return sum(1 for n in graph.node if n.op_type == "MatMulInteger" and n.name in wanted)


def int8_census(directory: Path, name: str) -> dict[str, int]:
    """The variant's matrix products by arithmetic; an INT8 build that quantized none of them is an error."""

    counts = matmul_census(directory / "model.onnx")
    if counts["int8_matmuls"] == 0:
        raise QuantizeError(f"{name}: no matrix product was quantized ({counts})")
    return counts


def weight_record(choice: Choice) -> dict[str, Any]:
    """What a variant's record says about its INT8 weights: the format and how `auto` resolved."""
    return {"weight_format": choice.value, "weight_format_choice": choice.tag()}
