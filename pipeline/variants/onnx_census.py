"""Census of an ONNX graph's matrix products: which run in INT8 and which in float, which have no weight operand
(attention's activation products) and which are the FFN down-projections; reads the graph structure only."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
