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
from pipeline.core.params import CALIBRATION_METHODS, QuantizeParams
from pipeline.variants.calibration import TokenCalibrationReader, calibration_options
from pipeline.variants.onnx_census import activation_matmuls, ffn_output_matmuls, head_matmuls, matmul_census

if TYPE_CHECKING:
    import onnx

    from pipeline.core.machine import Choice

log = logging.getLogger(__name__)

# onnxruntime's contrib-op domain (the fused graph's Attention, SkipLayerNormalization, BiasGelu).
MS_DOMAIN = "com.microsoft"


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


def float_head(model: Path | onnx.GraphProto) -> list[str]:
    """`nodes_to_exclude` that keeps the classification head float (`head_matmuls`). onnxruntime's operator-format
    quantizer (dynamic INT8, and the passes before a static one: the FFN's dynamic products, the static
    `QAttention`) rewrites each Gemm as `<name>_MatMul` + `<name>_Add` before it reads the exclusions, so a head
    Gemm is excluded under both names."""
    head = head_matmuls(model)
    return head + [f"{name}_MatMul" for name in head]


def quantize_dynamic_onnx(src: Path, dst: Path, per_channel: bool = True, weight_format: str = "s8") -> None:
    """Weights to INT8 (`weight_format`) ahead of time, activations quantized on the fly per batch; the
    classification head's products stay float (`head_matmuls`)."""
    import onnx
    from onnxruntime.quantization import quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="dynq-") as tmp:
        clean = _without_value_info(src, Path(tmp) / "clean.onnx")
        # Fused contrib ops (SkipLayerNormalization, BiasGelu) have no ONNX shape inference: default to float.
        quantize_dynamic(str(clean), str(dst), per_channel=per_channel, **weight_options(weight_format),
                         op_types_to_quantize=["MatMul", "Gemm", "Attention", "Gather"],
                         nodes_to_exclude=float_head(clean),
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

    `src` is either the plain export or, faster, the graph `int8-dynamic` quantizes (onnxruntime's fused
    `Attention`, `SkipLayerNormalization`, `BiasGelu`; see `pipeline.variants.fusion`): each fused `Attention`
    becomes a `QAttention` with a calibrated input scale first (`static_int8_attention`), since the QDQ quantizer
    has no `Attention` op. Matrix products with a weight operand are quantized but the classification head's
    (`head_matmuls`); the two activation-only products of each attention layer stay float (inside `QAttention`
    or a readout layer's `MultiHeadAttention`, or `activation_matmuls` in the plain graph).

    Only the inputs of MatMul/Gemm (compute) and Gather (the embedding table, most of the file) are quantized:
    the products' outputs stay float (onnxruntime then runs each as one `MatMulIntegerToFloat`; a quantized
    output made it `QLinearMatMul` + `DequantizeLinear` + float bias `Add`, one more rounding per product), and
    consumers of a quantized activation other than the products (the residual `Add`/`SkipLayerNormalization`)
    read the float tensor (`float_for_other_consumers`), as `int8-dynamic` and QAT's fake quantizers do.
    With `dynamic_ffn_output_of` set to the FFN width, the FFN down-projections are left out of calibration
    (see `ffn_output_matmuls`) and quantized dynamically instead (`dynamic_int8_matmuls`). Pre-processing and
    that dynamic pass do not depend on the calibration method, so they run once for all methods.
    """
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    unknown = [m for m in dsts if m not in CALIBRATION_METHODS]
    if unknown:
        raise QuantizeError(f"unknown calibration method {unknown[0]!r}; use one of {CALIBRATION_METHODS}")
    with tempfile.TemporaryDirectory(prefix="quant-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        model = onnx.load(str(src))
        fused = any(n.domain == MS_DOMAIN for n in model.graph.node)
        if fused:
            # onnxruntime's pre-processing cannot type the contrib ops; ONNX's inference inside quantize_static
            # types the rest from the float types given here.
            typed_contrib_outputs(model)
            onnx.save(model, str(pre))
        else:
            # No symbolic shape inference (it fails on the exporter's graph); ONNX's own inference types every
            # tensor of the unfused graph, which is what the quantizer needs.
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        del model
        graph = onnx.load(str(pre), load_external_data=False).graph
        names = {i.name for i in graph.input}
        excluded = activation_matmuls(graph) + float_head(graph)
        fused_attention = fused_attentions(graph)
        ffn = ffn_output_matmuls(graph, dynamic_ffn_output_of) if dynamic_ffn_output_of else []
        base = pre
        if ffn:  # first, on the float graph: the dynamic quantizer rewrites Gemm as MatMul, QDQ or not
            base = Path(tmp) / "ffn-dynamic.onnx"
            converted = dynamic_int8_matmuls(pre, base, ffn, params.per_channel, params.weights())
            if converted != len(ffn):
                raise QuantizeError(f"only {converted} of {len(ffn)} FFN down-projections were quantized dynamically")
            if fused:  # the dynamic pass drops intermediate types
                with_types = onnx.load(str(base))
                typed_contrib_outputs(with_types)
                onnx.save(with_types, str(base))
        for method, dst in dsts.items():
            attention = Path(tmp) / f"attention-{method}.onnx"
            converted = static_int8_attention(base, attention, calibration, method, params, pad_id)
            if converted != fused_attention:  # a fused attention left float would run its Q/K/V product in FP32
                raise QuantizeError(f"only {converted} of {fused_attention} fused attentions became a static "
                                    f"QAttention ({method})")
            options = calibration_options(method, params, activation_symmetric=False)
            options["extra_options"]["OpTypesToExcludeOutputQuantization"] = ["MatMul", "Gemm"]
            quantize_static(
                str(attention), str(dst), TokenCalibrationReader(calibration, params.calibration_batch_size, names,
                                                            pad_id),
                quant_format=QuantFormat.QDQ, per_channel=params.per_channel, activation_type=QuantType.QUInt8,
                **weight_options(params.weights()),
                op_types_to_quantize=["MatMul", "Gemm", "Gather"], nodes_to_exclude=excluded, **options,
            )
            quantized = onnx.load(str(dst))
            float_for_other_consumers(quantized)
            onnx.save(quantized, str(dst))


def fused_attentions(graph: onnx.GraphProto) -> int:
    """How many of `graph`'s nodes are onnxruntime's fused `Attention` (the contrib op the fusion makes)."""
    return sum(1 for n in graph.node if n.op_type == "Attention" and n.domain == MS_DOMAIN)


def static_int8_attention(src: Path, dst: Path, calibration: Sequence[np.ndarray], method: str,
                          params: QuantizeParams, pad_id: int = 0) -> int:
    """Quantize each fused `Attention` of `src` into onnxruntime's `QAttention` with a calibrated (static) input
    scale; returns how many. Everything else is left as it is.

    onnxruntime's QDQ quantizer has no `Attention` op, and splitting it into a QDQ product + `Split` + float
    `MultiHeadAttention` ran slower than int8-dynamic's `QAttention` (docs/weight-formats.md). Its operator-format
    quantizer has one (`AttentionQuant`): run here in static mode, on the ranges onnxruntime's calibrator
    (`method`, as the QDQ pass uses) measures at each `Attention`'s input, the packed Q/K/V product and the
    attention run in the same kernel as int8-dynamic's, with the input quantized by a fixed `QuantizeLinear`
    instead of a per-batch range (the Q/K/V weights are 7-bit, as `AttentionQuant` always makes them)."""
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import create_calibrator
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode

    model = onnx.load(str(src))
    if not fused_attentions(model.graph):
        onnx.save(model, str(dst))
        return 0
    options = calibration_options(method, params, activation_symmetric=False)
    extra = options["extra_options"]
    with tempfile.TemporaryDirectory(prefix="qattention-") as tmp:
        calibrator = create_calibrator(
            src, ["Attention"], augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=options["calibrate_method"],
            extra_options={"percentile": extra["CalibPercentile"]} if "CalibPercentile" in extra else {})
        calibrator.collect_data(TokenCalibrationReader(calibration, params.calibration_batch_size,
                                                       {i.name for i in model.graph.input}, pad_id))
        ranges = calibrator.compute_data()
        del calibrator
    weights = weight_options(params.weights())
    # onnxruntime's operator-format quantizer (what `quantize_static` runs for QOperator), called directly to keep
    # the dynamic kernels with calibrated attention ranges; not in the package's public API, hence every argument
    # by name: a reordering in a new onnxruntime fails here instead of binding silently
    quantizer = ONNXQuantizer(model=model, per_channel=params.per_channel, reduce_range=weights["reduce_range"],
                              mode=QuantizationMode.IntegerOps, static=True, weight_qType=weights["weight_type"],
                              activation_qType=QuantType.QUInt8, tensors_range=ranges, nodes_to_quantize=None,
                              nodes_to_exclude=None, op_types_to_quantize=["Attention"], extra_options=extra)
    quantized = quantizer.quantize_model()
    typed_contrib_outputs(quantized)
    onnx.save(quantized, str(dst))
    return sum(1 for n in quantized.graph.node if n.op_type == "QAttention")


def typed_contrib_outputs(model: onnx.ModelProto) -> None:
    """Declare every output of an onnxruntime contrib op (which ONNX's shape inference cannot type) as float:
    the QDQ quantizer leaves a product whose input has no known type in float, silently."""
    from onnx import TensorProto, helper

    graph = model.graph
    typed = {v.name for v in graph.value_info} | {o.name for o in graph.output}
    for node in graph.node:
        if node.domain == MS_DOMAIN:
            for name in node.output:
                if name and name not in typed:
                    graph.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
                    typed.add(name)


def float_for_other_consumers(model: onnx.ModelProto) -> int:
    """Point every consumer of a calibrated activation's `DequantizeLinear` that is not a quantized product
    (MatMul/Gemm) back at the float tensor; returns how many inputs were rewired.

    onnxruntime's QDQ quantizer feeds all consumers of a quantized tensor from one Q/DQ pair, so the residual
    `Add` (or `SkipLayerNormalization`) after each LayerNorm read the uint8-rounded copy of the hidden states,
    a rounding the float model, `int8-dynamic` and QAT's fake quantizers do not have. The embedding `Gather`'s
    output pair is kept: onnxruntime folds it into a Gather on the INT8 table."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    weights = {init.name for init in graph.initializer}
    rewired = 0
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm", "Gather"):
            continue
        for k, name in enumerate(node.input):
            dq = producer.get(name)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is None or q.op_type != "QuantizeLinear" or q.input[0] in weights:
                continue
            source = producer.get(q.input[0])
            if source is not None and source.op_type == "Gather":
                continue
            node.input[k] = q.input[0]
            rewired += 1
    return rewired


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
