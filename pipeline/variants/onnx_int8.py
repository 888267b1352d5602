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

    `src` is either the plain export or, faster, the graph `int8-dynamic` quantizes (onnxruntime's fused
    `Attention`, `SkipLayerNormalization`, `BiasGelu`; see `pipeline.variants.fusion`): each fused `Attention`
    is first split into its packed Q/K/V product and a float `MultiHeadAttention` (`attention_as_projection`),
    since the QDQ quantizer has no `Attention` op. Matrix products with a weight operand are quantized; the two
    activation-only products of each attention layer stay float (inside `MultiHeadAttention`, or
    `activation_matmuls` in the plain graph).

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
            attention_as_projection(model)
            typed_contrib_outputs(model)
            onnx.save(model, str(pre))
        else:
            # No symbolic shape inference (it fails on the exporter's graph); ONNX's own inference types every
            # tensor of the unfused graph, which is what the quantizer needs.
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        del model
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
            if fused:  # the dynamic pass drops intermediate types
                with_types = onnx.load(str(base))
                typed_contrib_outputs(with_types)
                onnx.save(with_types, str(base))
        for method, dst in dsts.items():
            options = calibration_options(method, params, activation_symmetric=False)
            options["extra_options"]["OpTypesToExcludeOutputQuantization"] = ["MatMul", "Gemm"]
            quantize_static(
                str(base), str(dst), TokenCalibrationReader(calibration, params.calibration_batch_size, names,
                                                            pad_id),
                quant_format=QuantFormat.QDQ, per_channel=params.per_channel, activation_type=QuantType.QUInt8,
                **weight_options(params.weights()),
                op_types_to_quantize=["MatMul", "Gemm", "Gather"], nodes_to_exclude=excluded, **options,
            )
            quantized = onnx.load(str(dst))
            float_for_other_consumers(quantized)
            onnx.save(quantized, str(dst))


#: Attributes a fused `Attention` may carry that `MultiHeadAttention` takes unchanged.
_MHA_ATTRIBUTES = ("num_heads", "scale", "mask_filter_value")


def attention_as_projection(model: onnx.ModelProto) -> int:
    """Replace each fused `Attention` (packed Q/K/V weight, bias, raw padding mask) by the same computation in
    ops the QDQ quantizer handles: one `MatMul` with the packed weight, a `Split` into Q, K and V, and a float
    `MultiHeadAttention` that adds the bias and applies the mask as its key padding mask. Returns how many were
    replaced; an `Attention` with inputs or attributes beyond those is left as it is (and stays float)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    replaced = 0
    for node in graph.node:
        inputs = list(node.input) + [""] * (4 - len(node.input))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(inputs[1])
        if (node.op_type != "Attention" or node.domain != MS_DOMAIN or weight is None or not inputs[2]
                or any(inputs[4:]) or set(attrs) - set(_MHA_ATTRIBUTES) or len(node.output) > 1):
            nodes.append(node)
            continue
        prefix = node.name or node.output[0]
        width = int(weight.dims[1]) // 3
        sizes = f"{prefix}_split_sizes"
        graph.initializer.append(numpy_helper.from_array(np.array([width] * 3, dtype=np.int64), sizes))
        qkv = [f"{prefix}_{part}" for part in ("q", "k", "v")]
        nodes += [
            helper.make_node("MatMul", inputs[:2], [f"{prefix}_qkv"], name=f"{prefix}_qkv_matmul"),
            helper.make_node("Split", [f"{prefix}_qkv", sizes], qkv, name=f"{prefix}_qkv_split", axis=-1),
            helper.make_node("MultiHeadAttention", [*qkv, inputs[2], inputs[3]], [node.output[0]],
                             name=f"{prefix}_mha", domain=MS_DOMAIN, **attrs),
        ]
        replaced += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return replaced


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
