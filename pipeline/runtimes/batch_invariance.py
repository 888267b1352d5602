"""Whether a variant's answer for one review can depend on the other reviews of its batch, and how it is scored.

A review must get the same label and score alone and inside any batch (server-side batching puts one client's
review next to other clients' reviews and their padding). Float graphs meet that: padded positions are masked
out and the rest is the same arithmetic. Graphs with onnxruntime's dynamic quantization do not:
`DynamicQuantizeLinear` takes one activation scale and zero point over the whole input tensor, every row and
padded position of the batch included, so a review's INT8 rounding moves with its neighbours. Such graphs
(`int8-dynamic`, `int8-pruned`, `int8-distilled`, and `int8-static`/`int8-qat` when their FFN down-projections
are quantized per batch) are scored row by row, each review unpadded in a batch of its own: exactly its
answer alone. The measured cost is in RESULTS.md and docs/batch-invariance.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

#: Ops that compute an activation's quantization parameters at run time over the whole input tensor (the file's
#: `DynamicQuantizeLinear`; the fused forms onnxruntime builds from it at load, should a file hold them).
PER_TENSOR_DYNAMIC_OPS = ("DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM")

#: Ops of an OpenVINO IR that quantize an activation with a scale calibrated once (NNCF's static INT8). Static scales
#: span no batch, but the float kernels between them are picked by the batch's shape (another blocking, another order
#: of summation): a float difference of one rounding can move an activation across a quantization step, and that
#: step reaches the score (docs/batch-invariance.md#openvino-int8-too: past the scoring contract on an AVX2 CPU).
STATIC_QUANTIZE_IR_OPS = ("FakeQuantize",)

#: How a runner scores a padded batch: `batched` in one call, `rows` one unpadded review per call, `auto` rows
#: exactly when the graph quantizes activations at run time over the batch (ONNX) or at all (OpenVINO IR).
Batching = Literal["auto", "batched", "rows"]
BATCHING_MODES = ("auto", "batched", "rows")


def per_tensor_dynamic_ops(model: Path) -> dict[str, int]:
    """Op type -> count of the graph's ops whose activation scale spans the batch (empty for a batch-invariant
    graph). Reads the graph structure only, not external weight data."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    counts = Counter(n.op_type for n in graph.node if n.op_type in PER_TENSOR_DYNAMIC_OPS)
    return dict(sorted(counts.items()))


def static_quantize_ir_ops(model: Path) -> dict[str, int]:
    """Op type -> count of an OpenVINO IR's activation quantizers (`STATIC_QUANTIZE_IR_OPS`; empty for a float IR).
    Reads the IR's XML (its layers' types), not its weights."""
    from xml.etree import ElementTree

    layers = ElementTree.parse(model).getroot().iter("layer")
    counts = Counter(t for t in (layer.get("type") for layer in layers) if t in STATIC_QUANTIZE_IR_OPS)
    return dict(sorted(counts.items()))


def batch_dependent_ops(model: Path) -> dict[str, int]:
    """The ops that can move a review's answer with its batch: an OpenVINO IR's (`.xml`) activation quantizers, an
    ONNX graph's per-tensor dynamic quantization."""
    return static_quantize_ir_ops(model) if model.suffix == ".xml" else per_tensor_dynamic_ops(model)


def scores_rows_alone(model: Path, batching: Batching = "auto") -> bool:
    """Whether a model (ONNX, or OpenVINO IR) is scored one review per call under `batching`."""
    if batching not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {BATCHING_MODES}, not {batching!r}")
    if batching != "auto":
        return batching == "rows"
    return bool(batch_dependent_ops(model))


def score_batch(run: Callable[[np.ndarray, np.ndarray], np.ndarray], input_ids: np.ndarray,
                attention_mask: np.ndarray, rows_alone: bool) -> np.ndarray:
    """Logits of a padded batch from `run`: in one call, or, when `rows_alone`, one call per review with the review
    cut to its own attention mask (exactly its answer alone). A fully masked row has no positions of its own and
    is scored as given."""
    if not rows_alone or (len(input_ids) <= 1 and bool(np.all(attention_mask))):
        return run(input_ids, attention_mask)
    rows = []
    for ids, mask in zip(input_ids, attention_mask, strict=True):
        keep = mask.astype(bool)
        if not keep.any():
            keep[:] = True
        rows.append(run(ids[keep][None, :], mask[keep][None, :]))
    return np.concatenate(rows, axis=0)


def batching_record(fmt: str, model: Path) -> dict[str, Any]:
    """What the record of a servable variant in format `fmt` (its model file `model`) says, and so its MLflow run
    and model, about how it is served: `served_batching` is `batched` or `rows`, with the reason."""
    ops = batch_dependent_ops(model) if fmt in ("onnx", "openvino") else {}
    if not ops:
        return {"served_batching": "batched",
                "served_batching_reason": "float activations (no run-time per-tensor scales): a review's answer "
                                          "does not depend on its batch, so a batch is scored in one call"}
    listed = ", ".join(f"{n} {op}" for op, n in ops.items())
    if fmt == "openvino":
        why = (f"static INT8 ({listed}): scales calibrated once, but the float kernels between them follow the "
               "batch's shape, and a float rounding difference can move an activation across a quantization step")
    else:
        why = (f"{listed}: one activation scale per batch tensor would move a review's score with its neighbours "
               "and their padding")
    return {"served_batching": "rows",
            "served_batching_reason": f"{why}, so every review is scored unpadded on its own (the same answer alone "
                                      "and in any batch)"}
