"""The INT8 input of a TensorRT engine: a QDQ model in the form TensorRT's explicit quantization accepts (signed
symmetric int8, per-channel weights, Q/DQ only), and the check that a file is one."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.params import CALIBRATION_METHODS, QuantizeParams
from pipeline.variants.calibration import TokenCalibrationReader, calibration_options
from pipeline.variants.onnx_census import INTEGER_OPS, activation_matmuls, ffn_output_matmuls, matmul_census
from pipeline.variants.onnx_int8 import QuantizeError

#: What a TensorRT explicit-quantization input may hold besides float ops: QuantizeLinear/DequantizeLinear only.
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


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
