"""Census of an ONNX graph's matrix products: which run in INT8 and which in float, which have no weight operand
(attention's activation products), which are the FFN down-projections and which the classification head; reads
the graph structure only."""

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


#: The layer normalizations an encoder ends with: ONNX's own and onnxruntime's fused ones (`pipeline.variants.fusion`).
NORMALIZATIONS = ("LayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization")


def head_matmuls(model: Path | Any) -> list[str]:
    """The weight products after the encoder's last layer normalization: the classification head (BERT's pooler
    and classifier, DistilBERT's pre-classifier and classifier, a mean-pooling head's classifier). Kept float.

    They multiply one pooled vector per review, so INT8 saves them almost nothing, while onnxruntime runs them
    quantized at a cost out of proportion: dynamic INT8 quantizes the vector on every run, and a static QDQ graph
    dequantized their weights on every run instead of fusing the pairs (docs/weight-formats.md has the
    measurements). The graph is in topological order, so every node after the last normalization is downstream of
    the whole encoder."""
    graph = _graph(model)
    norms = [i for i, n in enumerate(graph.node) if n.op_type in NORMALIZATIONS]
    if not norms:
        return []
    weights = {init.name for init in graph.initializer}
    return [n.name for n in list(graph.node)[norms[-1] + 1:]
            if n.op_type in ("MatMul", "Gemm") and any(i in weights for i in n.input[:2])]


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
