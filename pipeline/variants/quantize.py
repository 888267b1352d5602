"""The `quantize` stage's work: `int8-dynamic` (fused graph, dynamic INT8), `int8-openvino` (OpenVINO IR, NNCF
static INT8), `int8-static` (QDQ, calibration method chosen on validation reviews) and `int8-qat` (QAT, then the
same QDQ conversion)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core.machine import Choice
from pipeline.core.params import Params, QuantizeParams, TrainParams, to_dict
from pipeline.data.tokens import draw_rows, read_tokenized, training_window
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.base import predict_logits
from pipeline.runtimes.catalog import directories
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.record import VariantInfo, read_variant, write_variant
from pipeline.variants.calibration import calibration_reviews
from pipeline.variants.export import export_onnx, inference_model, max_length_of
from pipeline.variants.fusion import FusionCheck, fused_graph
from pipeline.variants.onnx_int8 import (
    QuantizeError,
    int8_census,
    quantize_dynamic_onnx,
    quantize_static_onnx,
    weight_record,
)
from pipeline.variants.openvino_int8 import quantize_openvino

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeInputs:
    """What every INT8 build of one run shares: the finetuned model's record, its reviews and the choices
    derived once from params and the fp32-onnx record."""

    finetuned: Path
    meta: dict[str, Any]  # the finetuned model's pipeline.json
    pad_id: int
    train: pd.DataFrame
    calibration: list[np.ndarray]
    ffn_width: int | None  # FFN down-projections quantized per batch when set (quantize.ffn_output_dynamic)
    cls_readout: bool
    tmp: Path


def run_quantize(*, finetuned: Path, fp32_onnx: Path, tokenized: Path, variants_root: Path,
                 params: Params, choice: Choice) -> dict[str, Any]:
    """`int8-dynamic`, `int8-openvino`, `int8-static` (calibration method chosen on validation reviews) and
    `int8-qat`, each when `quantize.build` lists it (the rest are written as skipped with the reason), with INT8
    weights in the format `choice` (how the stage resolved `quantize.weight_format`)."""
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
    val = read_tokenized(tokenized, "val").iloc[: q.selection_samples]
    report: dict[str, Any] = {}

    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        inputs = QuantizeInputs(
            finetuned, meta, pad_id(tokenizer), train,
            calibration_reviews(train, params),
            int(arch["intermediate_size"]) if q.ffn_output_dynamic else None,
            bool(arch.get("cls_readout", False)), Path(tmp))

        if "int8-dynamic" in q.build:
            t0 = time.perf_counter()
            base, fusion = _graph_for_quantization(model, fp32_onnx / "model.onnx", inputs, q, arch,
                                                   val["input_ids"].tolist()[:16])
            out["int8-dynamic"].mkdir(parents=True, exist_ok=True)
            quantize_dynamic_onnx(base, out["int8-dynamic"] / "model.onnx", q.per_channel, q.weights())
            report["int8-dynamic"] = {"method": "onnxruntime.quantize_dynamic", "per_channel": q.per_channel,
                                      **weight_record(choice),
                                      "fused_graph": q.optimize_graph, **fusion,
                                      **int8_census(out["int8-dynamic"], "int8-dynamic"),
                                      "build_seconds": round(time.perf_counter() - t0, 2)}
            write_variant(out["int8-dynamic"], VariantInfo.built("int8-dynamic", report["int8-dynamic"]), finetuned)
        else:
            _skip_unbuilt(("int8-dynamic",), q, out, finetuned, report)
        if "int8-openvino" in q.build:
            graph, readout = inference_model(model, params.export.cls_readout)  # the graph fp32-onnx holds
            report["int8-openvino"] = {**quantize_openvino(graph, inputs.calibration, inputs.pad_id,
                                                          q.calibration_batch_size, out["int8-openvino"]),
                                       **readout}
            write_variant(out["int8-openvino"], VariantInfo.built("int8-openvino", report["int8-openvino"]),
                          finetuned)
        else:
            _skip_unbuilt(("int8-openvino",), q, out, finetuned, report)
        if not {"int8-static", "int8-qat"} & set(q.build):
            _skip_unbuilt(("int8-static", "int8-qat"), q, out, finetuned, report)
            return report
        t0 = time.perf_counter()
        # Static QDQ starts from the unfused export: onnxruntime's fused contrib ops carry no type
        # information, and quantize_static silently leaves every MatMul fed by them in float.
        # onnxruntime applies its fusions around the QDQ nodes when the session loads. int8-qat reuses the
        # calibration method chosen here, so the selection runs when either is built.
        best = _static_with_selection(fp32_onnx / "model.onnx", inputs, val, q)
        if "int8-static" in q.build:
            out["int8-static"].mkdir(parents=True, exist_ok=True)
            (inputs.tmp / f"static-{best['method']}.onnx").replace(out["int8-static"] / "model.onnx")
            report["int8-static"] = {"method": "onnxruntime.quantize_static (QDQ)", "calibration": best["method"],
                                     "calibration_samples": len(inputs.calibration), "per_channel": q.per_channel,
                                     **weight_record(choice),
                                     "dynamic_ffn_output": inputs.ffn_width is not None,
                                     "cls_readout": inputs.cls_readout, "selection_val_accuracy": best["scores"],
                                     **int8_census(out["int8-static"], "int8-static"),
                                     "build_seconds": round(time.perf_counter() - t0, 2)}
            write_variant(out["int8-static"], VariantInfo.built("int8-static", report["int8-static"]), finetuned)
        else:
            _skip_unbuilt(("int8-static",), q, out, finetuned, report)

        if "int8-qat" in q.build:
            t0 = time.perf_counter()
            report["int8-qat"] = _qat(inputs, best["method"], out["int8-qat"], q, params.train,
                                      training_window(meta, tokenizer))
            report["int8-qat"].update(int8_census(out["int8-qat"], "int8-qat"), **weight_record(choice),
                                      build_seconds=round(time.perf_counter() - t0, 2))
            write_variant(out["int8-qat"], VariantInfo.built("int8-qat", report["int8-qat"]), finetuned)
        else:
            _skip_unbuilt(("int8-qat",), q, out, finetuned, report)
    return report


def _skip_unbuilt(names: tuple[str, ...], q: QuantizeParams, out: dict[str, Path], finetuned: Path,
                  report: dict[str, Any]) -> None:
    """Write each of `names` (not in `quantize.build`) as a skipped variant with the reason."""
    reason = (f"not in quantize.build ({', '.join(q.build)}); "
              "add it there or run a profile that builds it (make run PROFILE=full)")
    for name in names:
        log.warning("%s skipped: %s", name, reason)
        write_variant(out[name], VariantInfo.skipped(name, reason, to_dict(q)), finetuned)
        report[name] = {"status": "skipped", "reason": reason}


def _graph_for_quantization(model: Any, fp32_onnx: Path, inputs: QuantizeInputs, params: QuantizeParams,
                            arch: dict[str, Any], seqs: list[np.ndarray]) -> tuple[Path, dict[str, Any]]:
    """The graph `int8-dynamic` quantizes (fused for onnxruntime, attention included, when `optimize_graph`)
    and what the fusion did.

    The fused graph is checked against `fp32-onnx` on real reviews, and a fusion that finds fewer attention
    blocks than the model has layers is logged and recorded rather than silently accepted.
    """
    if not params.optimize_graph:
        return fp32_onnx, {}
    check = FusionCheck(OrtRunner(fp32_onnx, optimization="disable"), "fp32-onnx", int(arch["num_layers"]),
                        max_length_of(inputs.meta), seqs, inputs.pad_id)
    return fused_graph(model, inputs.cls_readout, check, inputs.tmp)


def _static_with_selection(base: Path, inputs: QuantizeInputs, val: pd.DataFrame,
                           params: QuantizeParams) -> dict[str, Any]:
    """Build one static model per calibration method; keep the most accurate on validation reviews.

    With a single method there is nothing to choose, so no validation pass is spent on it (`scores` is empty).
    """
    from pipeline.variants.onnx_int8 import quantize_static_onnx_methods

    seqs, labels = val["input_ids"].tolist(), val["label"].to_numpy()
    paths = {method: inputs.tmp / f"static-{method}.onnx" for method in params.calibration_methods}
    quantize_static_onnx_methods(base, paths, inputs.calibration, params, inputs.pad_id, inputs.ffn_width)
    if len(paths) == 1:
        method = next(iter(paths))
        log.info("int8-static calibration %s: the only method configured, no selection pass", method)
        return {"method": method, "scores": {}}
    scores: dict[str, float] = {}
    for method, path in paths.items():
        logits = predict_logits(OrtRunner(path), seqs, params.calibration_batch_size, pad_id=inputs.pad_id,
                                progress=f"select {method}")
        scores[method] = float((logits.argmax(-1) == labels).mean())
        log.info("int8-static calibration %s: validation accuracy %.4f", method, scores[method])
    best = max(scores, key=lambda m: (scores[m], -params.calibration_methods.index(m)))
    return {"method": best, "scores": scores}


def _qat(inputs: QuantizeInputs, method: str, out: Path, params: QuantizeParams, train: TrainParams,
         window: Any = None) -> dict[str, Any]:
    """`int8-qat`: QAT on `params.qat_train_samples` training reviews (in the finetune stage's training window),
    then the static QDQ conversion with the calibration `method` int8-static chose. The QAT finetune checkpoints and
    resumes under `train.checkpoint_dir/qat` like the other training jobs."""
    from pipeline.core.io import token_fingerprint
    from pipeline.surgery.fake_quant import FAKE_QUANT_API
    from pipeline.training.checkpoints import CheckpointStore
    from pipeline.training.fingerprint import fingerprint
    from pipeline.training.qat import qat_finetune

    seed = train.seed

    model, _, _ = load_finetuned(inputs.finetuned)
    model.train()
    idx = draw_rows(len(inputs.train), params.qat_train_samples, seed + 1)
    reviews = [inputs.train["input_ids"].iloc[i] for i in idx]
    if window is not None:
        reviews = [window(ids) for ids in reviews]
    labels = inputs.train["label"].to_numpy()[idx]
    store = CheckpointStore.for_job(train, "qat")
    settings = {"quantize": to_dict(params), "seed": seed, "ffn_width": inputs.ffn_width,
                "reviews": token_fingerprint(reviews), "labels": token_fingerprint([labels])}
    plan = store.plan(fingerprint(settings, [inputs.finetuned]), train.resume)
    result = qat_finetune(model, reviews, labels, params, seed, inputs.pad_id, inputs.ffn_width, store=store,
                          plan=plan)
    fp32 = inputs.tmp / "qat-fp32.onnx"
    graph, readout = inference_model(model, inputs.cls_readout)  # qat_finetune leaves the model in eval mode
    export_onnx(graph, fp32, max_length_of(inputs.meta))
    out.mkdir(parents=True, exist_ok=True)
    quantize_static_onnx(fp32, out / "model.onnx", inputs.calibration, method, params, inputs.pad_id,
                         inputs.ffn_width)
    linears = "every Linear but the FFN down-projections (quantized per batch)" if inputs.ffn_width else "every Linear"
    return {"method": f"QAT ({FAKE_QUANT_API} on {linears}) + onnxruntime QDQ", "calibration": method,
            "qat_samples": result.samples, "qat_steps": result.steps, "qat_epochs": params.qat_epochs,
            "qat_max_length": max(len(ids) for ids in reviews),
            "qat_lr": params.qat_lr, "qat_distillation": params.qat_distillation,
            "qat_final_loss": round(result.final_loss, 4), **{f"qat_{k}": v for k, v in plan.record().items()},
            "fake_quant_layers": result.wrapped_layers, "dynamic_ffn_output": inputs.ffn_width is not None,
            **readout}
