"""onnxruntime INT8 building blocks: dynamic and static (QDQ, calibrated) quantization, per-batch FFN
down-projections, and the census of which matrix products ended up in INT8."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.errors import UserError
from pipeline.core.machine import WEIGHT_FORMATS
from pipeline.core.params import Params, QuantizeParams
from pipeline.runtimes.base import pad_batch

if TYPE_CHECKING:
    import pandas as pd

    from pipeline.core.machine import Choice

log = logging.getLogger(__name__)


CALIBRATION_METHODS = ("minmax", "percentile", "entropy")


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


class TokenCalibrationReader:
    """onnxruntime `CalibrationDataReader` over real, length-sorted review batches."""

    def __init__(self, seqs: Sequence[np.ndarray], batch_size: int, input_names: set[str], pad_id: int = 0) -> None:
        order = np.argsort([len(s) for s in seqs])
        self.batches = [[seqs[i] for i in order[b : b + batch_size]] for b in range(0, len(order), batch_size)]
        self.input_names = input_names
        self.pad_id = pad_id
        # One width for all batches: histogram calibrators (percentile, entropy) stack them.
        self.width = max((len(s) for s in seqs), default=1)
        self._it: Iterator[list[np.ndarray]] | None = None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = iter(self.batches)
        batch = next(self._it, None)
        if batch is None:
            return None
        ids, mask = pad_batch(batch, self.pad_id, self.width)
        feed = {"input_ids": ids, "attention_mask": mask}
        return {k: v for k, v in feed.items() if k in self.input_names}

    def rewind(self) -> None:
        self._it = None


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


#: What a TensorRT explicit-quantization input may hold besides float ops: QuantizeLinear/DequantizeLinear only.
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def calibration_reviews(train: pd.DataFrame, params: Params) -> list[np.ndarray]:
    """The training reviews every static INT8 build calibrates on: `quantize.calibration_samples` of them,
    drawn with `train.seed` (the TensorRT INT8 input is calibrated on the same ones)."""
    from pipeline.data.tokens import draw_rows

    rows = draw_rows(len(train), params.quantize.calibration_samples, params.train.seed)
    return [train["input_ids"].iloc[i] for i in rows]


def calibration_options(method: str, params: QuantizeParams, activation_symmetric: bool) -> dict[str, Any]:
    """`quantize_static`'s calibration method and extra options shared by every QDQ build: symmetric
    per-channel weights, float biases (int32 bias scales need a calibrated input scale, which sliced inputs such
    as the pooler's [CLS] `select` do not get, and float biases cost nothing measurable), fused contrib ops typed
    float, the percentile from params; activations asymmetric uint8 for onnxruntime, symmetric for TensorRT."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod

    extra: dict[str, Any] = {"ActivationSymmetric": activation_symmetric, "WeightSymmetric": True,
                             "QuantizeBias": False, "DefaultTensorType": onnx.TensorProto.FLOAT}
    if method == "percentile":
        extra["CalibPercentile"] = params.calibration_percentile
    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    return {"calibrate_method": methods[method], "extra_options": extra}


def quantize_qdq_for_tensorrt(src: Path, dst: Path, calibration: Sequence[np.ndarray], method: str,
                              params: QuantizeParams, pad_id: int = 0,
                              float_ffn_output_of: int | None = None) -> dict[str, Any]:
    """The INT8 input of a TensorRT engine: a QDQ model in the form TensorRT's explicit quantization accepts.

    Signed int8 everywhere with zero points 0 (symmetric activations, calibrated with `method` on real reviews,
    and per-channel symmetric weights with the full 8-bit range: GPUs have no int16 saturation), and nothing but
    QuantizeLinear/DequantizeLinear around float ops: no per-batch `DynamicQuantizeLinear`/`MatMulInteger` (the
    FFN down-projections that `int8-static` quantizes per batch stay float here when `float_ffn_output_of` gives
    the FFN width: one calibrated symmetric range over their GELU input, outliers and all, costs accuracy) and no
    onnxruntime contrib op. The other weight products are quantized; the two activation-only products per
    attention layer stay float, as in `int8-static`; TensorRT runs float layers in its own precision.
    Returns the census, checked with `tensorrt_qdq_problems` (an unusable model raises `QuantizeError`)."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in CALIBRATION_METHODS:
        raise QuantizeError(f"unknown calibration method {method!r}; use one of {CALIBRATION_METHODS}")
    with tempfile.TemporaryDirectory(prefix="trtqdq-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        graph = onnx.load(str(pre), load_external_data=False).graph
        ffn = ffn_output_matmuls(graph, float_ffn_output_of) if float_ffn_output_of else []
        keep_float = [*activation_matmuls(graph), *ffn]
        quantize_static(
            str(pre), str(dst),
            TokenCalibrationReader(calibration, params.calibration_batch_size, {i.name for i in graph.input}, pad_id),
            quant_format=QuantFormat.QDQ, per_channel=True, reduce_range=False,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul", "Gemm"], nodes_to_exclude=keep_float,
            **calibration_options(method, params, activation_symmetric=True),
        )
    problems = tensorrt_qdq_problems(dst)
    if problems:
        raise QuantizeError(f"{dst} is not a valid TensorRT INT8 input: {'; '.join(problems[:5])}")
    return {"calibration": method, "calibration_samples": len(calibration), "float_ffn_output": len(ffn),
            **matmul_census(dst)}


def tensorrt_qdq_problems(path: Path) -> list[str]:
    """What keeps an ONNX file from being a TensorRT explicit-quantization input (empty when it is one):
    ops outside the ONNX domain, integer/dynamic quantization ops, Q/DQ that are not signed int8 with zero
    points 0, and weight DequantizeLinear nodes that are not per channel."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    problems = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{node.name}: {node.domain}.{node.op_type} is not a standard ONNX op")
        elif node.op_type in (*INTEGER_OPS, "DynamicQuantizeLinear", "ConvInteger", "QLinearConv"):
            problems.append(f"{node.name}: {node.op_type} has no TensorRT importer")
        elif node.op_type in QDQ_OPS:
            zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if zero is None:
                problems.append(f"{node.name}: no int8 zero point (uint8 by default)")
                continue
            if zero.data_type != onnx.TensorProto.INT8:
                problems.append(f"{node.name}: zero point of type {onnx.TensorProto.DataType.Name(zero.data_type)}")
            if np.any(numpy_helper.to_array(zero) != 0):
                problems.append(f"{node.name}: asymmetric (non-zero zero point)")
            if node.op_type == "DequantizeLinear" and node.input[0] in inits:
                scale = inits.get(node.input[1])
                if scale is not None and len(scale.dims) != 1:
                    problems.append(f"{node.name}: weight scale is per tensor, not per channel")
    return problems


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


def _graph(model: Path | Any) -> Any:
    """An ONNX graph from a file path (weights' external data not loaded), or the graph passed in."""
    import onnx

    return onnx.load(str(model), load_external_data=False).graph if isinstance(model, str | Path) else model


def activation_matmuls(model: Path | Any) -> list[str]:
    """MatMuls with no weight input (attention scores x values): kept float, as in dynamic quantization.

    Their inputs are softmax probabilities and per-token activations whose uint8 per-tensor rounding costs
    BERT measurable accuracy, while the weight products carry almost all the compute.
    """
    graph = _graph(model)
    weights = {init.name for init in graph.initializer}
    return [n.name for n in graph.node if n.op_type == "MatMul" and not any(i in weights for i in n.input[:2])]


def ffn_output_matmuls(model: Path | Any, intermediate_size: int) -> list[str]:
    """MatMuls whose weight has `intermediate_size` input rows: each layer's FFN down-projection.

    Their input is the GELU output, whose few large outliers make a per-tensor uint8 range coarse for
    everything else (the accuracy each choice cost is in RESULTS.md); `dynamic_int8_matmuls` quantizes them
    per batch instead.
    """
    graph = _graph(model)
    rows = {init.name: (init.dims[0] if init.dims else 0) for init in graph.initializer}
    return [n.name for n in graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and rows.get(n.input[1]) == intermediate_size]


INTEGER_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "MatMulIntegerToFloat", "QAttention",
               "QGemm")


def matmul_census(path: Path) -> dict[str, int]:
    """How many matrix products run in INT8 vs float: catches a quantizer that silently skipped layers."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    # A fused float `Attention` node hides its QKV projection: it counts as one float product. A
    # `MultiHeadAttention` node (inputs already projected, e.g. the [CLS]-readout layer's) hides the two
    # activation products, scores and context, which count as the two float MatMuls they replace.
    float_ops = [n for n in graph.node if n.op_type in ("MatMul", "Gemm", "Attention")]
    qdq = [n for n in float_ops if all(producer.get(i) == "DequantizeLinear" for i in n.input[:2])]
    integer = [n for n in graph.node if n.op_type in INTEGER_OPS]
    mha = sum(1 for n in graph.node if n.op_type == "MultiHeadAttention")
    return {"int8_matmuls": len(qdq) + len(integer), "float_matmuls": len(float_ops) - len(qdq) + 2 * mha}


def int8_census(directory: Path, name: str) -> dict[str, int]:
    """The variant's matrix products by arithmetic; an INT8 build that quantized none of them is an error."""

    counts = matmul_census(directory / "model.onnx")
    if counts["int8_matmuls"] == 0:
        raise QuantizeError(f"{name}: no matrix product was quantized ({counts})")
    return counts


def weight_record(choice: Choice) -> dict[str, Any]:
    """What a variant's record says about its INT8 weights: the format and how `auto` resolved."""
    return {"weight_format": choice.value, "weight_format_choice": choice.tag()}
