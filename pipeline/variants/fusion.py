"""onnxruntime's BERT fusions (one `Attention` op per layer, SkipLayerNorm, BiasGelu) of the torch.export-based
ONNX graph, done by onnxscript's onnxruntime fusion rewriter and checked against a reference on real reviews;
shared by `int8-dynamic` and `int8-pruned`."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.params import ExportParams
from pipeline.data.tokens import read_tokenized
from pipeline.runtimes.base import Runner
from pipeline.runtimes.ort import OrtRunner
from pipeline.variants.export import eager_runner, export_onnx, inference_model, parity
from pipeline.variants.onnx_int8 import MS_DOMAIN, QuantizeError, int8_census, quantize_dynamic_onnx, weight_record

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch

    from pipeline.core.machine import Choice

log = logging.getLogger(__name__)

def optimize_for_quantization(src: Path, dst: Path) -> dict[str, int]:
    """onnxscript's onnxruntime fusions of a torch.export-based ONNX file before quantizing; returns the fused
    (com.microsoft) operators of the result by type.

    `optimize_for_ort` fuses each layer's scaled-dot-product attention with its Q/K/V projections into one
    `Attention` op (which `quantize_dynamic` turns into `QAttention`: INT8 QKV projection, attention in one
    kernel), residual Add + LayerNorm into `SkipLayerNormalization` and bias + GELU into `BiasGelu`.
    onnxruntime's own transformer optimizer finds no attention in this graph (it fuses only SkipLayerNorm
    and BiasGelu there). The embeddings are not fused into `EmbedLayerNormalization`, which would keep the
    word-embedding table (half of MiniLM's weights) in float; a plain `Gather` is quantized with the rest.
    Each `Attention` gets its packed Q/K/V weight as one initializer: the rewriter packs them with a `Concat`
    that its constant folding leaves alone (over its default size limit), and a computed weight would be
    quantized per call, per tensor, with the float copies kept in the file. Two more edits make the fused ops
    quantizable, see `padding_mask_as_mask_index`.
    """
    import onnx_ir as ir
    from onnxscript.optimizer import fold_constants
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, _ = optimize_for_ort(ir.load(str(src)))
    fold_constants(model, should_fold=_packs_attention_weights)
    padding_mask_as_mask_index(model)
    ir.save(model, str(dst))
    return dict(sorted(Counter(n.op_type for n in model.graph if n.domain == MS_DOMAIN).items()))


def _packs_attention_weights(node: ir.Node) -> bool | None:
    """Fold (True) a `Concat` that feeds a fused `Attention`; the folder's default rules (None) for the rest."""
    if node.op_type == "Concat" and any(c.op_type == "Attention" for c in node.outputs[0].consumers()):
        return True
    return None


def padding_mask_as_mask_index(model: ir.Model, mask_input: str = "attention_mask") -> int:
    """Feed every fused `Attention` the padding mask as its `mask_index` input; returns how many were changed.

    onnxscript passes the mask as an additive `attention_bias` (the exporter's 4-D float mask built from
    `attention_mask`), an input `QAttention` does not have: onnxruntime's quantizer would drop it and attend to
    padding. For an encoder that bias is the key padding mask, which `Attention` takes directly as the raw
    (batch, sequence) 0/1 `mask_index`. Only a bias computed from `mask_input` alone is replaced; the parity
    check against fp32-onnx on padded reviews (`fused_graph`) catches any other meaning. The
    `qkv_hidden_sizes` attribute is dropped where Q, K and V are equally wide (the op's default), since
    onnxruntime's quantizer leaves an `Attention` that carries it in float.
    """
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    mask = next((v for v in graph.inputs if v.name == mask_input), None)
    mask_index: ir.Value | None = None
    changed = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain != MS_DOMAIN:
            continue
        sizes = node.attributes.get("qkv_hidden_sizes")
        if sizes is not None and len(set(sizes.as_ints())) == 1:
            node.attributes.pop("qkv_hidden_sizes")
        inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
        if mask is None or inputs[3] is not None or inputs[5] is None or _graph_inputs_of(inputs[5]) != {mask_input}:
            continue
        if mask_index is None:  # one int32 cast of the graph input, shared by every layer
            cast = ir.node("Cast", [mask], {"to": ir.DataType.INT32}, name="attention_mask_index",
                           outputs=[ir.Value(name="attention_mask_index")])
            graph.insert_before(graph.node(0), cast)
            mask_index = cast.outputs[0]
        node.replace_input_with(3, mask_index)
        node.replace_input_with(5, None)
        changed += 1
    RemoveUnusedNodesPass()(model)
    return changed


def _graph_inputs_of(value: ir.Value) -> set[str]:
    """Names of the graph inputs `value` is computed from."""
    seen: set[int] = set()
    found: set[str] = set()
    stack: list[ir.Value | None] = [value]
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            found.add(v.name or "")
        producer = v.producer()
        if producer is not None:
            stack.extend(producer.inputs)
    return found


@dataclass(frozen=True)
class FusionCheck:
    """What a fused graph must reproduce, on which reviews, how closely, and how many attention blocks it should
    fuse."""

    reference: Runner
    reference_name: str
    num_layers: int
    max_length: int
    reviews: list[np.ndarray]  # real reviews the fused graph is compared on
    pad_id: int
    tolerance: float  # the largest |logit diff| allowed: fusion reorders float sums, nothing more

    @classmethod
    def of(cls, reference: Runner, reference_name: str, *, num_layers: int, max_length: int,
           val_ids: Sequence[np.ndarray], pad_id: int, export: ExportParams) -> FusionCheck:
        """The export stage's parity check applied to a fused graph: on the first `export.parity_samples` of
        `val_ids` (validation reviews), within `export.parity_tolerance`."""
        return cls(reference, reference_name, num_layers, max_length, list(val_ids[: export.parity_samples]), pad_id,
                   export.parity_tolerance)

    @classmethod
    def of_model(cls, model: torch.nn.Module, name: str, *, tokenized: Path, max_length: int, pad_id: int,
                 export: ExportParams) -> FusionCheck:
        """`of` with `model` itself in PyTorch as the reference, on the validation split under `tokenized` (a
        pruned or distilled model, whose fused graph has no fp32-onnx to answer to)."""
        return cls.of(eager_runner(model), name, num_layers=int(model.config.num_hidden_layers),
                      max_length=max_length, val_ids=read_tokenized(tokenized, "val")["input_ids"].tolist(),
                      pad_id=pad_id, export=export)


def fused_graph(model: Any, cls_readout: bool, check: FusionCheck, tmp: Path, *,
                opset: int) -> tuple[Path, dict[str, Any]]:
    """Export `model` (with the [CLS] readout when asked and possible, see `inference_model`) with the
    torch.export-based exporter in eager attention at `opset` (`export.opset`), then `fuse_export` it.

    The model is exported with eager attention (and left switched to it: pass one you own): the exporter's
    decomposition of `scaled_dot_product_attention` keeps a no-op Reshape for single-head layers (a pruned model)
    that onnxscript's attention pattern does not match, and a [CLS] readout layer's attention only fuses into
    `MultiHeadAttention` from the eager graph, while the eager graph fuses at any head count."""
    model.set_attn_implementation("eager")
    graph, readout = inference_model(model, cls_readout)
    raw = tmp / "for-fusion.onnx"
    export_onnx(graph, raw, check.max_length, opset)
    return fuse_export(raw, readout, check, tmp)


def fuse_export(raw: Path, readout: dict[str, Any], check: FusionCheck, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """Fuse `raw`, a torch.export-based ONNX file of a model in eager attention whose [CLS] readout is as `readout`
    records (`inference_model`), into `tmp/fused.onnx` (`optimize_for_quantization`), and check it against
    `check.reference` on real reviews.

    A readout last layer has no packed Q/K/V projection (its query reads the [CLS] position only), so one fewer
    of the `num_layers` attention blocks becomes `Attention` then; its attention proper still fuses into a float
    `MultiHeadAttention`. A fusion that finds fewer attention blocks than that is logged and recorded."""
    num_layers = check.num_layers - int(readout["cls_readout"])
    fused = tmp / "fused.onnx"
    counts = optimize_for_quantization(raw, fused)
    p = parity(check.reference, OrtRunner(fused, optimization="disable"), check.reviews, check.pad_id)
    if p.max_abs_diff > check.tolerance:
        raise QuantizeError(f"fused graph disagrees with {check.reference_name}: "
                            f"max |logit diff| {p.max_abs_diff:.2e} > {check.tolerance:.0e}")
    if counts.get("Attention", 0) != num_layers:
        log.warning("onnxscript fused %d of %d attention blocks; the rest are quantized as plain MatMuls",
                    counts.get("Attention", 0), num_layers)
    return fused, {**readout, "fusions": counts, "fused_attention": counts.get("Attention", 0),
                   "fused_parity_max_abs_diff": p.max_abs_diff}


def fused_dynamic_int8(model: Any, name: str, out_dir: Path, check: FusionCheck, *, export: ExportParams,
                       per_channel: bool, weight_format: Choice, tmp: Path) -> dict[str, Any]:
    """The `int8-dynamic` recipe for any model of the teacher's family (a pruned or distilled one): exported as
    `export` asks (the [CLS] readout, the opset), fused and checked against `check.reference` (`fused_graph`), then
    dynamic INT8 with per-channel weights in the CPU's `weight_format` choice. Returns what goes into the variant's
    record."""
    fused, fusion = fused_graph(model, export.cls_readout, check, tmp, opset=export.opset)
    out_dir.mkdir(parents=True, exist_ok=True)
    quantize_dynamic_onnx(fused, out_dir / "model.onnx", per_channel, str(weight_format.value))
    return {"per_channel": per_channel, **weight_record(weight_format), **fusion, **int8_census(out_dir, name)}
