"""The `quantize` stage's work: `int8-dynamic` (fused graph, dynamic INT8), `int8-openvino` (OpenVINO IR, NNCF
static INT8), `int8-static` (QDQ, calibration method chosen on validation reviews), `int8-qat` (QAT, then the
same QDQ conversion) and `int8-qat-openvino` (QAT through NNCF's quantizers, then OpenVINO IR)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core.machine import Choice
from pipeline.core.params import Params, QuantizeParams, to_dict
from pipeline.data.tokens import draw_rows, read_tokenized, training_window
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.base import Runner, predict_logits
from pipeline.runtimes.catalog import directories
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.record import VariantInfo, building, read_variant, write_skipped, write_variant
from pipeline.variants.calibration import calibration_reviews
from pipeline.variants.export import eager_runner, export_onnx, inference_model, max_length_of
from pipeline.variants.fusion import FusionCheck, fuse_export, fused_graph
from pipeline.variants.onnx_int8 import (
    QuantizeError,
    int8_census,
    quantize_dynamic_onnx,
    quantize_static_onnx,
    weight_record,
)
from pipeline.variants.openvino_int8 import quantize_openvino

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


def _build_dynamic(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    q = inputs.q
    base, fusion = inputs.graph_for_quantization()
    quantize_dynamic_onnx(base, out / "model.onnx", q.per_channel, q.weights())
    return {"method": "onnxruntime.quantize_dynamic", "per_channel": q.per_channel, **weight_record(inputs.choice),
            "fused_graph": q.optimize_graph, **fusion, **int8_census(out, "int8-dynamic")}


def _build_openvino(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    graph, readout = inference_model(inputs.model, inputs.params.export.cls_readout)  # the graph fp32-onnx holds
    return {**quantize_openvino(graph, inputs.calibration, inputs.pad_id, inputs.q.calibration_batch_size, out),
            **readout}


def _build_static(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    q, best = inputs.q, inputs.static_calibration()
    # a rename: `inputs.tmp` is on the variants' filesystem (`scratch_directory`)
    (inputs.tmp / f"static-{best['method']}.onnx").replace(out / "model.onnx")
    return {"method": "onnxruntime.quantize_static (QDQ)", "calibration": best["method"],
            "fused_graph": inputs.q.optimize_graph, **best["fusion"],
            "calibration_samples": len(inputs.calibration), "per_channel": q.per_channel,
            **weight_record(inputs.choice), "dynamic_ffn_output": inputs.ffn_width is not None,
            "cls_readout": inputs.cls_readout, "selection_val_accuracy": best["scores"],
            **int8_census(out, "int8-static")}


def _build_qat(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    record = _qat(inputs, inputs.static_calibration()["method"], out)
    return {**record, **int8_census(out, "int8-qat"), **weight_record(inputs.choice)}


def _build_qat_openvino(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    """`int8-qat-openvino` (`pipeline.variants.openvino_qat`): QAT reviews and int8-openvino's calibration."""
    from pipeline.variants.openvino_int8 import calibration_batches
    from pipeline.variants.openvino_qat import QatJob, qat_openvino

    model, _, _ = load_finetuned(inputs.finetuned)  # a fresh copy: QAT changes the weights it trains
    graph, readout = inference_model(model, inputs.params.export.cls_readout)  # the graph int8-openvino converts
    reviews, labels = _qat_reviews(inputs, inputs.q.qat_openvino_train_samples)
    job = QatJob(params=inputs.q, train=inputs.params.train, finetuned=inputs.finetuned, pad_id=inputs.pad_id,
                 calibration=calibration_batches(inputs.calibration, inputs.pad_id, inputs.q.calibration_batch_size),
                 reviews=reviews, labels=labels, check_reviews=inputs.val["input_ids"].tolist()[:16])
    return {**qat_openvino(graph, job, out), "calibration_samples": len(inputs.calibration), **readout}


#: The quantize stage's builders, one per variant of `quantize.build`, in the order they run (int8-qat reuses the
#: calibration method int8-static chose). Each writes its files into the directory it is given (`building`'s, which
#: replaces the variant's directory once the record is in it) and returns its record; `run_quantize` times it and
#: writes the built or skipped record the same way for all.
BUILDERS: dict[str, Callable[[QuantizeInputs, Path], dict[str, Any]]] = {
    "int8-dynamic": _build_dynamic,
    "int8-openvino": _build_openvino,
    "int8-static": _build_static,
    "int8-qat": _build_qat,
    "int8-qat-openvino": _build_qat_openvino,
}


def run_quantize(*, finetuned: Path, fp32_onnx: Path, tokenized: Path, variants_root: Path,
                 params: Params, choice: Choice) -> dict[str, Any]:
    """`int8-dynamic`, `int8-openvino`, `int8-static` (calibration method chosen on validation reviews), `int8-qat`
    and `int8-qat-openvino`, each when `quantize.build` lists it (the rest are written as skipped with the reason),
    with INT8 weights in the format `choice` (how the stage resolved `quantize.weight_format`; the OpenVINO
    variants' weights are NNCF's signed 8-bit)."""
    log.info("quantize.weight_format: %s", choice.tag())
    q = dataclasses.replace(params.quantize, weight_format=choice.value)  # every builder below sees the format
    out = directories(variants_root)
    model, tokenizer, meta = load_finetuned(finetuned)
    arch = read_variant(fp32_onnx).params
    # Static QDQ starts from the fp32-onnx file, so its readout must be the one params ask for now.
    from pipeline.runtimes.readout import unsupported

    expected = params.export.cls_readout and unsupported(model) is None  # what export records (`inference_model`)
    if bool(arch.get("cls_readout", False)) != expected:
        raise QuantizeError(f"{fp32_onnx} was exported with cls_readout={arch.get('cls_readout')}; "
                            f"export.cls_readout is {params.export.cls_readout}: re-run the export stage")
    train = read_tokenized(tokenized, "train")
    report: dict[str, Any] = {}
    skipped = (f"not in quantize.build ({', '.join(q.build)}); "
               "add it there or run a profile that builds it (make run PROFILE=full)")
    with scratch_directory(variants_root, "quantize") as tmp:
        inputs = QuantizeInputs(
            finetuned=finetuned, fp32_onnx=fp32_onnx, model=model, tokenizer=tokenizer, meta=meta, arch=arch,
            pad_id=pad_id(tokenizer), train=train, val=read_tokenized(tokenized, "val").iloc[: q.selection_samples],
            calibration=calibration_reviews(train, params),
            ffn_width=int(arch["intermediate_size"]) if q.ffn_output_dynamic else None,
            cls_readout=bool(arch.get("cls_readout", False)), params=params, q=q, choice=choice, tmp=tmp)
        for name, build in BUILDERS.items():
            if name not in q.build:
                log.warning("%s skipped: %s", name, skipped)
                write_skipped(out[name], VariantInfo.skipped(name, skipped, to_dict(q)), finetuned)
                report[name] = {"status": "skipped", "reason": skipped}
                continue
            with building(out[name]) as work:
                t0 = time.perf_counter()
                report[name] = {**build(inputs, work), "build_seconds": round(time.perf_counter() - t0, 2)}
                write_variant(work, VariantInfo.built(name, report[name]), finetuned)
    return report


@contextlib.contextmanager
def scratch_directory(variants_root: Path, stage: str) -> Iterator[Path]:
    """A temporary directory for `stage`'s intermediate models, inside `variants_root` and removed afterwards.

    A model built there is moved into its variant directory with a rename (`_build_static`), which only works
    within one filesystem: from the system temporary directory (often a tmpfs) it fails with EXDEV (invalid
    cross-device link). Hidden (a leading dot), so nothing that lists the variants takes it for one."""
    variants_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{stage}-", dir=variants_root) as tmp:
        yield Path(tmp)


def _graph_for_quantization(inputs: QuantizeInputs) -> tuple[Path, dict[str, Any]]:
    """The graph `int8-dynamic` quantizes (fused for onnxruntime, attention included, when `optimize_graph`)
    and what the fusion did.

    The fused graph is checked against `fp32-onnx` on 16 validation reviews, and a fusion that finds fewer
    attention blocks than the model has layers is logged and recorded rather than silently accepted. The export
    stage writes fp32-onnx in eager attention, the form the fusion needs, so that file is fused as it is; one
    exported otherwise (its record says how) is exported again from the model.
    """
    fp32 = inputs.fp32_onnx / "model.onnx"
    if not inputs.q.optimize_graph:
        return fp32, {}
    check = _fusion_check(inputs, OrtRunner(fp32, optimization="disable"), "fp32-onnx")
    if inputs.arch.get("attention") == "eager":
        readout = {k: inputs.arch[k] for k in ("cls_readout", "cls_readout_reason") if k in inputs.arch}
        return fuse_export(fp32, readout, check, inputs.tmp)
    return fused_graph(inputs.model, inputs.cls_readout, check, inputs.tmp)


def _qat_fused_graph(inputs: QuantizeInputs, model: Any, graph: Any, readout: dict[str, Any],
                     check: FusionCheck) -> tuple[Path, dict[str, Any]]:
    """The QAT model's fused graph (`graph`, `readout`: `inference_model` of the QAT `model`). QAT changes the
    weights, not the architecture, so where fp32-onnx holds the eager-attention graph the fusion needs, that graph
    with the QAT weights put in (`refill_weights`) is fused instead of exporting the QAT model again; otherwise, or
    where the graph cannot be refilled or its fusion fails the check, the QAT model is exported (`fused_graph`).
    The record says which (`qat_graph`)."""
    from pipeline.variants.onnx_weights import refill_weights

    tmp = inputs.tmp / "qat"
    tmp.mkdir(exist_ok=True)
    model.set_attn_implementation("eager")  # the reference `check` runs it: the form both graphs are in
    if inputs.arch.get("attention") == "eager":
        before, _ = inference_model(inputs.model, inputs.cls_readout)  # fp32-onnx's tensors, under graph's names
        raw = tmp / "refilled.onnx"
        if refill_weights(inputs.fp32_onnx / "model.onnx", raw, _tensors(before), _tensors(graph)) is not None:
            try:
                src, fusion = fuse_export(raw, readout, check, tmp)
                return src, {**fusion, "qat_graph": "fp32-onnx's graph with the QAT weights"}
            except QuantizeError as exc:
                log.warning("the refilled QAT graph failed its check (%s): exporting the QAT model instead", exc)
    src, fusion = fused_graph(model, inputs.cls_readout, check, tmp)
    return src, {**fusion, "qat_graph": "exported from the QAT model"}


def _tensors(model: Any) -> dict[str, np.ndarray]:
    """A model's parameters and buffers by name, as numpy arrays."""
    return {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}


def _fusion_check(inputs: QuantizeInputs, reference: Runner, reference_name: str) -> FusionCheck:
    """What a fused graph of this run must reproduce (`reference`, named `reference_name` in errors), on the first
    16 validation reviews."""
    return FusionCheck(reference, reference_name, int(inputs.arch["num_layers"]), max_length_of(inputs.meta),
                       inputs.val["input_ids"].tolist()[:16], inputs.pad_id)


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


def _qat(inputs: QuantizeInputs, method: str, out: Path) -> dict[str, Any]:
    """`int8-qat`: QAT on `params.qat_train_samples` training reviews (in the finetune stage's training window),
    then the static QDQ conversion with the calibration `method` int8-static chose. The QAT finetune checkpoints and
    resumes under `train.checkpoint_dir/qat` like the other training jobs."""
    from pipeline.core.io import token_fingerprint
    from pipeline.surgery.fake_quant import FAKE_QUANT_API
    from pipeline.training.checkpoints import CheckpointStore
    from pipeline.training.fingerprint import fingerprint
    from pipeline.training.qat import qat_finetune

    params, train = inputs.q, inputs.params.train
    seed = train.seed
    model, _, _ = load_finetuned(inputs.finetuned)  # a fresh copy: QAT changes the weights it trains
    model.train()
    reviews, labels = _qat_reviews(inputs, params.qat_train_samples)
    store = CheckpointStore.for_job(train, "qat")
    settings = {"quantize": to_dict(params), "seed": seed, "ffn_width": inputs.ffn_width,
                "reviews": token_fingerprint(reviews), "labels": token_fingerprint([labels])}
    plan = store.plan(fingerprint(settings, [inputs.finetuned]), train.resume)
    result = qat_finetune(model, reviews, labels, params, seed, inputs.pad_id, inputs.ffn_width, store=store,
                          plan=plan)
    graph, readout = inference_model(model, inputs.cls_readout)  # qat_finetune leaves the model in eval mode
    if params.optimize_graph:
        # The same fused graph as int8-static's, checked against the QAT model itself in PyTorch (as the export
        # stage checks fp32-onnx).
        src, fusion = _qat_fused_graph(inputs, model, graph, readout,
                                       _fusion_check(inputs, eager_runner(model), "the QAT model (PyTorch)"))
    else:
        src, fusion = inputs.tmp / "qat-fp32.onnx", {}
        export_onnx(graph, src, max_length_of(inputs.meta))
    out.mkdir(parents=True, exist_ok=True)
    quantize_static_onnx(src, out / "model.onnx", inputs.calibration, method, params, inputs.pad_id,
                         inputs.ffn_width)
    linears = "every Linear but the FFN down-projections (quantized per batch)" if inputs.ffn_width else "every Linear"
    return {"method": f"QAT ({FAKE_QUANT_API} on {linears}) + onnxruntime QDQ", "calibration": method,
            "qat_samples": result.samples, "qat_steps": result.steps, "qat_epochs": params.qat_epochs,
            "qat_max_length": max(len(ids) for ids in reviews),
            "qat_lr": params.qat_lr, "qat_distillation": params.qat_distillation,
            "qat_final_loss": round(result.final_loss, 4), **{f"qat_{k}": v for k, v in plan.record().items()},
            "fake_quant_layers": result.wrapped_layers, "dynamic_ffn_output": inputs.ffn_width is not None,
            "fused_graph": params.optimize_graph, **fusion, **readout}


def _qat_reviews(inputs: QuantizeInputs, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """`count` training reviews for QAT (drawn with the training seed + 1: the first `n` of a larger draw are the
    smaller one's), cut to the finetune stage's training window, and their labels."""
    window = training_window(inputs.meta, inputs.tokenizer)
    idx = draw_rows(len(inputs.train), count, inputs.params.train.seed + 1)
    reviews = [inputs.train["input_ids"].iloc[i] for i in idx]
    if window is not None:
        reviews = [window(ids) for ids in reviews]
    return reviews, inputs.train["label"].to_numpy()[idx]

