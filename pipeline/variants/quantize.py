"""The `quantize` stage's work: `int8-dynamic` (fused graph, dynamic INT8), `int8-static` (QDQ, calibration
method chosen on validation reviews) and `int8-qat` (QAT, then the same QDQ conversion)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.params import QuantizeParams
from pipeline.data.tokens import draw_rows, read_tokenized, training_window
from pipeline.modeling import load_finetuned
from pipeline.variants.export import (
    export_onnx,
    inference_model,
    max_length_of,
)
from pipeline.variants.fusion import fused_graph
from pipeline.variants.onnx_int8 import int8_census
from pipeline.variants.record import VariantInfo, write_variant
from pipeline.variants.runners import OrtRunner, predict_logits

log = logging.getLogger(__name__)


def run_quantize(finetuned: Path, fp32_onnx: Path, tokenized: Path, out_dirs: dict[str, Path],
                 params: QuantizeParams, train_seed: int = 42) -> dict[str, Any]:
    """`int8-dynamic`, `int8-static` (calibration method chosen on validation reviews) and `int8-qat`."""
    from pipeline.variants.onnx_int8 import quantize_dynamic_onnx
    from pipeline.variants.record import read_variant

    model, tokenizer, meta = load_finetuned(finetuned)
    pad = tokenizer.pad_token_id or 0
    arch = read_variant(fp32_onnx).params
    readout = bool(arch.get("cls_readout", False))  # the fp32-onnx export's; static QDQ starts from that file
    train = read_tokenized(tokenized, "train")
    val = read_tokenized(tokenized, "val").iloc[: params.selection_samples]
    calibration = [train["input_ids"].iloc[i] for i in draw_rows(len(train), params.calibration_samples, train_seed)]
    report: dict[str, Any] = {}

    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        base, fusion = _graph_for_quantization(model, readout, fp32_onnx / "model.onnx", Path(tmp), params, arch,
                                               meta, val["input_ids"].tolist()[:16], pad)
        ffn_width = int(arch["intermediate_size"]) if params.ffn_output_dynamic else None

        t0 = time.perf_counter()
        d = out_dirs["int8-dynamic"]
        d.mkdir(parents=True, exist_ok=True)
        quantize_dynamic_onnx(base, d / "model.onnx", params.per_channel, params.reduce_range)
        report["int8-dynamic"] = {"method": "onnxruntime.quantize_dynamic", "per_channel": params.per_channel,
                                  "reduce_range": params.reduce_range,
                                  "fused_graph": params.optimize_graph, **fusion,
                                  **int8_census(out_dirs["int8-dynamic"], "int8-dynamic"),
                                  "build_seconds": round(time.perf_counter() - t0, 2)}
        write_variant(d, VariantInfo("int8-dynamic", "onnx", "int8", "model.onnx", params=report["int8-dynamic"]),
                      finetuned)

        t0 = time.perf_counter()
        # Static QDQ starts from the unfused export: onnxruntime's fused contrib ops carry no type
        # information, and quantize_static silently leaves every MatMul fed by them in float.
        # onnxruntime applies its fusions around the QDQ nodes when the session loads.
        best = _static_with_selection(fp32_onnx / "model.onnx", Path(tmp), calibration, val, params, pad,
                                      ffn_width)
        d = out_dirs["int8-static"]
        d.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / f"static-{best['method']}.onnx").replace(d / "model.onnx")
        report["int8-static"] = {"method": "onnxruntime.quantize_static (QDQ)", "calibration": best["method"],
                                 "calibration_samples": len(calibration), "per_channel": params.per_channel,
                                 "reduce_range": params.reduce_range,
                                 "dynamic_ffn_output": ffn_width is not None,
                                 "cls_readout": readout,
                                 "selection_val_accuracy": best["scores"],
                                 **int8_census(out_dirs["int8-static"], "int8-static"),
                                 "build_seconds": round(time.perf_counter() - t0, 2)}
        write_variant(d, VariantInfo("int8-static", "onnx", "int8", "model.onnx", params=report["int8-static"]),
                      finetuned)

        t0 = time.perf_counter()
        report["int8-qat"] = _qat(finetuned, train, calibration, best["method"], Path(tmp), out_dirs["int8-qat"],
                                  params, meta, pad, train_seed, ffn_width, training_window(meta, tokenizer),
                                  readout)
        report["int8-qat"].update(int8_census(out_dirs["int8-qat"], "int8-qat"),
                                  build_seconds=round(time.perf_counter() - t0, 2))
        write_variant(out_dirs["int8-qat"], VariantInfo("int8-qat", "onnx", "int8", "model.onnx",
                                                        params=report["int8-qat"]), finetuned)
    return report


def _graph_for_quantization(model: Any, cls_readout: bool, fp32_onnx: Path, tmp: Path, params: QuantizeParams,
                            arch: dict[str, Any], meta: dict[str, Any], seqs: list[np.ndarray],
                            pad: int) -> tuple[Path, dict[str, Any]]:
    """The graph `int8-dynamic` quantizes (onnxruntime-fused, attention included, when `optimize_graph`)
    and what the fusion did.

    The fused graph is checked against `fp32-onnx` on real reviews, and a fusion that finds fewer attention
    blocks than the model has layers is logged and recorded rather than silently accepted.
    """
    if not params.optimize_graph:
        return fp32_onnx, {}
    return fused_graph(model, cls_readout, OrtRunner(fp32_onnx, optimization="disable"), "fp32-onnx", tmp,
                        arch["num_heads"], arch["hidden_size"], arch["num_layers"], max_length_of(meta), seqs, pad)


def _static_with_selection(base: Path, tmp: Path, calibration: list[np.ndarray], val: Any, params: QuantizeParams,
                           pad: int, ffn_width: int | None) -> dict[str, Any]:
    """Build one static model per calibration method; keep the most accurate on validation reviews.

    With a single method there is nothing to choose, so no validation pass is spent on it (`scores` is empty).
    """
    from pipeline.variants.onnx_int8 import quantize_static_onnx_methods

    seqs, labels = val["input_ids"].tolist(), val["label"].to_numpy()
    paths = {method: tmp / f"static-{method}.onnx" for method in params.calibration_methods}
    quantize_static_onnx_methods(base, paths, calibration, params.per_channel, params.calibration_batch_size, pad,
                                 ffn_width, params.reduce_range)
    if len(paths) == 1:
        method = next(iter(paths))
        log.info("int8-static calibration %s: the only method configured, no selection pass", method)
        return {"method": method, "scores": {}}
    scores: dict[str, float] = {}
    for method, path in paths.items():
        logits = predict_logits(OrtRunner(path), seqs, params.calibration_batch_size, pad_id=pad,
                                progress=f"select {method}")
        scores[method] = float((logits.argmax(-1) == labels).mean())
        log.info("int8-static calibration %s: validation accuracy %.4f", method, scores[method])
    best = max(scores, key=lambda m: (scores[m], -params.calibration_methods.index(m)))
    return {"method": best, "scores": scores}


def _qat(finetuned: Path, train: Any, calibration: list[np.ndarray], method: str, tmp: Path, out: Path,
         params: QuantizeParams, meta: dict[str, Any], pad: int, seed: int, ffn_width: int | None,
         window: Any = None, cls_readout: bool = False) -> dict[str, Any]:
    from pipeline.variants.onnx_int8 import quantize_static_onnx
    from pipeline.variants.qat import qat_finetune

    model, _, _ = load_finetuned(finetuned)
    model.train()
    idx = draw_rows(len(train), params.qat_train_samples, seed + 1)
    reviews = [train["input_ids"].iloc[i] for i in idx]
    if window is not None:
        reviews = [window(ids) for ids in reviews]
    result = qat_finetune(model, reviews, train["label"].to_numpy()[idx],
                          params.qat_epochs, params.qat_batch_size, params.qat_lr, seed, pad, ffn_width,
                          params.reduce_range, params.qat_distillation)
    fp32 = tmp / "qat-fp32.onnx"
    graph, readout = inference_model(model, cls_readout)  # qat_finetune leaves the model in eval mode
    export_onnx(graph, fp32, max_length_of(meta))
    out.mkdir(parents=True, exist_ok=True)
    quantize_static_onnx(fp32, out / "model.onnx", calibration, method, params.per_channel,
                         params.calibration_batch_size, pad, ffn_width, params.reduce_range)
    linears = "every Linear but the FFN down-projections (quantized per batch)" if ffn_width else "every Linear"
    return {"method": f"QAT (torch.ao FakeQuantize on {linears}) + onnxruntime QDQ", "calibration": method,
            "qat_samples": result.samples, "qat_steps": result.steps, "qat_epochs": params.qat_epochs,
            "qat_max_length": max(len(ids) for ids in reviews),
            "qat_lr": params.qat_lr, "qat_distillation": params.qat_distillation,
            "qat_final_loss": round(result.final_loss, 4),
            "fake_quant_layers": result.wrapped_layers, "dynamic_ffn_output": ffn_width is not None,
            "reduce_range": params.reduce_range, **readout}
