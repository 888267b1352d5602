"""What every INT8 build of one `quantize` run shares (`QuantizeInputs`): the finetuned model and its reviews, the
graph onnxruntime's INT8 starts from (fused once), the static calibration method chosen once on validation reviews,
the fusion check and QAT's training reviews."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core.machine import Choice
from pipeline.core.params import Params, QuantizeParams
from pipeline.data.tokens import draw_rows, training_window
from pipeline.runtimes.base import Runner, predict_logits
from pipeline.runtimes.ort import OrtRunner
from pipeline.variants.export import max_length_of
from pipeline.variants.fusion import FusionCheck, fuse_export, fused_graph

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class QuantizeInputs:
    """What every INT8 build of one run shares: the finetuned model's record, its reviews and the choices
    derived once from params and the fp32-onnx record (the static calibration method is chosen on first use, by
    whichever of int8-static and int8-qat is built first)."""

    finetuned: Path
    fp32_onnx: Path
    model: Any  # the finetuned classifier (eval mode)
    tokenizer: Any
    meta: dict[str, Any]  # the finetuned model's pipeline.json
    arch: dict[str, Any]  # the fp32-onnx record's params (layers, widths, readout)
    pad_id: int
    train: pd.DataFrame
    val: pd.DataFrame
    calibration: list[np.ndarray]
    ffn_width: int | None  # FFN down-projections quantized per batch when set (quantize.ffn_output_dynamic)
    cls_readout: bool
    params: Params
    q: QuantizeParams  # params.quantize with the weight format resolved
    choice: Choice  # how the stage resolved quantize.weight_format
    qat_choice: Choice  # how the stage resolved quantize.qat_precision
    tmp: Path
    _static: dict[str, Any] | None = None
    _fused: tuple[Path, dict[str, Any]] | None = None

    def static_calibration(self) -> dict[str, Any]:
        """The static QDQ model of each calibration method (in `tmp`) and the one chosen, built once."""
        if self._static is None:
            self._static = _static_with_selection(self)
        return self._static

    def graph_for_quantization(self) -> tuple[Path, dict[str, Any]]:
        """The finetuned model's graph as onnxruntime INT8 starts from, and what fusion did (built once; see
        `_graph_for_quantization`): int8-dynamic quantizes it dynamically, int8-static statically."""
        if self._fused is None:
            self._fused = _graph_for_quantization(self)
        return self._fused


def _graph_for_quantization(inputs: QuantizeInputs) -> tuple[Path, dict[str, Any]]:
    """The graph `int8-dynamic` quantizes (fused for onnxruntime, attention included, when `optimize_graph`)
    and what the fusion did.

    The fused graph is checked against `fp32-onnx` on `export.parity_samples` validation reviews, and a fusion
    that finds fewer attention blocks than the model has layers is logged and recorded rather than silently
    accepted. The export stage writes fp32-onnx in eager attention, the form the fusion needs, so that file is
    fused as it is; one exported otherwise (its record says how) is exported again from the model.
    """
    fp32 = inputs.fp32_onnx / "model.onnx"
    if not inputs.q.optimize_graph:
        return fp32, {}
    check = fusion_check(inputs, OrtRunner(fp32, optimization="disable"), "fp32-onnx")
    if inputs.arch.get("attention") == "eager":
        readout = {k: inputs.arch[k] for k in ("cls_readout", "cls_readout_reason") if k in inputs.arch}
        return fuse_export(fp32, readout, check, inputs.tmp)
    return fused_graph(inputs.model, inputs.cls_readout, check, inputs.tmp, opset=inputs.params.export.opset)


def fusion_check(inputs: QuantizeInputs, reference: Runner, reference_name: str) -> FusionCheck:
    """What a fused graph of this run must reproduce (`reference`, named `reference_name` in errors), on validation
    reviews as closely as the export stage's parity check asks (`FusionCheck.of`)."""
    return FusionCheck.of(reference, reference_name, num_layers=int(inputs.arch["num_layers"]),
                          max_length=max_length_of(inputs.meta), val_ids=inputs.val["input_ids"].tolist(),
                          pad_id=inputs.pad_id, export=inputs.params.export)


def _static_with_selection(inputs: QuantizeInputs) -> dict[str, Any]:
    """Build one static model per calibration method from the graph int8-dynamic quantizes (fused for
    onnxruntime when `quantize.optimize_graph`, else the fp32-onnx file); keep the most accurate on validation
    reviews.

    With a single method there is nothing to choose, so no validation pass is spent on it (`scores` is empty).
    """
    from pipeline.variants.onnx_int8 import quantize_static_onnx_methods

    params, val = inputs.q, inputs.val
    seqs, labels = val["input_ids"].tolist(), val["label"].to_numpy()
    paths = {method: inputs.tmp / f"static-{method}.onnx" for method in params.calibration_methods}
    src, fusion = inputs.graph_for_quantization()
    quantize_static_onnx_methods(src, paths, inputs.calibration, params, inputs.pad_id, inputs.ffn_width)
    if len(paths) == 1:
        method = next(iter(paths))
        log.info("int8-static calibration %s: the only method configured, no selection pass", method)
        return {"method": method, "scores": {}, "fusion": fusion}
    scores: dict[str, float] = {}
    for method, path in paths.items():
        logits = predict_logits(OrtRunner(path), seqs, params.calibration_batch_size, pad_id=inputs.pad_id,
                                progress=f"select {method}")
        scores[method] = float((logits.argmax(-1) == labels).mean())
        log.info("int8-static calibration %s: validation accuracy %.4f", method, scores[method])
    best = max(scores, key=lambda m: (scores[m], -params.calibration_methods.index(m)))
    return {"method": best, "scores": scores, "fusion": fusion}


def qat_reviews(inputs: QuantizeInputs, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """`count` training reviews for QAT (drawn with the training seed + 1: the same count draws the same reviews;
    draws of different counts overlap by chance only), cut to the finetune stage's training window, and their
    labels."""
    window = training_window(inputs.meta, inputs.tokenizer)
    idx = draw_rows(len(inputs.train), count, inputs.params.train.seed + 1)
    reviews = [inputs.train["input_ids"].iloc[i] for i in idx]
    if window is not None:
        reviews = [window(ids) for ids in reviews]
    return reviews, inputs.train["label"].to_numpy()[idx]
