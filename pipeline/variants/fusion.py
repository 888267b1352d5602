"""onnxruntime's BERT fusion (one `Attention` op per layer, SkipLayerNorm, BiasGelu) of an exported graph,
checked against a reference on real reviews; shared by `int8-dynamic` and `int8-pruned`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.variants.export import (
    export_onnx_for_fusion,
    inference_model,
    parity,
)
from pipeline.variants.runners import OrtRunner, Runner

log = logging.getLogger(__name__)

# The fused graph must compute what fp32-onnx computes: fusion reorders float sums, nothing more.
FUSION_TOLERANCE = 1e-4


def optimize_for_quantization(src: Path, dst: Path, num_heads: int, hidden_size: int) -> dict[str, int]:
    """onnxruntime's transformer fusions (Attention, SkipLayerNorm, BiasGelu) before quantizing; returns counts.

    The embedding fusion is left off: `EmbedLayerNormalization` would keep the word-embedding table (half
    of MiniLM's weights) in float, while a plain `Gather` is quantized to INT8 with the rest.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_embed_layer_norm = False
    model = optimize_model(str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                           opt_level=1, optimization_options=options)
    # Stale intermediate shapes from the exporter's example batch confuse later shape inference.
    del model.model.graph.value_info[:]
    model.save_model_to_file(str(dst))
    return {k: int(v) for k, v in model.get_fused_operator_statistics().items() if v}



@dataclass(frozen=True)
class FusionCheck:
    """What a fused graph must reproduce and the model shape onnxruntime's fusion needs to find attention."""

    reference: Runner
    reference_name: str
    num_heads: int
    hidden_size: int
    num_layers: int
    max_length: int
    reviews: list[np.ndarray]  # real reviews the fused graph is compared on
    pad_id: int


def fused_graph(model: Any, cls_readout: bool, check: FusionCheck, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """Export `model` (with the [CLS] readout when asked and possible, see `inference_model`) for onnxruntime's
    BERT fusion, fuse it, and check it against `check.reference` on real reviews.

    A readout last layer does not fuse (its single query is left as plain MatMuls), so one fewer of the
    `num_layers` attention blocks is expected then."""
    from pipeline.variants.onnx_int8 import QuantizeError

    graph, readout = inference_model(model, cls_readout)
    num_layers = check.num_layers - int(readout["cls_readout"])
    raw, fused = tmp / "for-fusion.onnx", tmp / "fused.onnx"
    export_onnx_for_fusion(graph, raw, check.max_length)
    counts = optimize_for_quantization(raw, fused, check.num_heads, check.hidden_size)
    p = parity(check.reference, OrtRunner(fused, optimization="disable"), check.reviews, check.pad_id)
    if p.max_abs_diff > FUSION_TOLERANCE:
        raise QuantizeError(f"fused graph disagrees with {check.reference_name}: "
                            f"max |logit diff| {p.max_abs_diff:.2e}")
    if counts.get("Attention", 0) != num_layers:
        log.warning("onnxruntime fused %d of %d attention blocks; the rest are quantized as plain MatMuls",
                    counts.get("Attention", 0), num_layers)
    return fused, {**readout, "fusions": counts, "fused_attention": counts.get("Attention", 0),
                   "fused_parity_max_abs_diff": p.max_abs_diff}
