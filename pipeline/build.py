"""Stage bodies that turn the finetuned model into variant directories: export, quantize, tensorrt."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ExportParams, PruneParams, QuantizeParams, TensorRTParams, to_dict
from pipeline.data import read_tokenized
from pipeline.export import (
    ExportError,
    check_dynamic_shapes,
    describe,
    eager_runner,
    export_onnx,
    export_onnx_for_fusion,
    export_torchscript,
    parity,
)
from pipeline.modeling import load_finetuned
from pipeline.variants import OrtRunner, TorchRunner, VariantInfo, predict_logits, write_variant

log = logging.getLogger(__name__)

# The fused graph must compute what fp32-onnx computes: fusion reorders float sums, nothing more.
FUSION_TOLERANCE = 1e-4


def _max_length(meta: dict[str, Any]) -> int:
    return int(meta["preprocessing"]["max_length"])


def _training_window(meta: dict[str, Any], tokenizer: Any) -> Any:
    """Shorten QAT reviews to the window the finetune stage trained on (`train.max_length` in the model's
    own record), so QAT steps cost what finetune steps cost; None when training used the full length."""
    from pipeline.data import window_shortener

    window = (meta.get("params", {}).get("train", {}) or {}).get("max_length")
    pre = meta["preprocessing"]
    return window_shortener(None if window is None else int(window), int(pre["max_length"]), pre["truncation"],
                            float(pre["head_fraction"]), tokenizer.cls_token_id, tokenizer.sep_token_id)


def inference_model(model: Any, cls_readout: bool) -> tuple[Any, dict[str, Any]]:
    """The model as it is exported, and the record of it: with the [CLS] readout (`pipeline.readout`) when
    asked for and possible, else the model itself with the reason logged and recorded."""
    from pipeline.readout import cls_readout as readout
    from pipeline.readout import unsupported

    reason = "export.cls_readout is false" if not cls_readout else unsupported(model)
    if reason is not None:
        if cls_readout:
            log.warning("exporting the whole last layer: %s", reason)
        return model, {"cls_readout": False, "cls_readout_reason": reason}
    return readout(model), {"cls_readout": True}


def run_export(finetuned: Path, tokenized: Path, out_dirs: dict[str, Path], params: ExportParams) -> dict[str, Any]:
    """`fp32-torchscript` and `fp32-onnx` (with the [CLS] readout when `export.cls_readout`), each checked
    for parity against the unchanged PyTorch model on real test reviews."""
    import torch

    model, tokenizer, meta = load_finetuned(finetuned)
    max_len = _max_length(meta)
    seqs = read_tokenized(tokenized, "test")["input_ids"].tolist()[: params.parity_samples]
    reference = eager_runner(model)
    graph, readout = inference_model(model, params.cls_readout)
    report: dict[str, Any] = {}

    d = out_dirs["fp32-torchscript"]
    t0 = time.perf_counter()
    export_torchscript(graph, d / "model.pt", max_len)
    runner = TorchRunner(torch.jit.load(str(d / "model.pt")))
    report["fp32-torchscript"] = _checked(reference, runner, seqs, params, max_len, t0, tokenizer.pad_token_id)
    write_variant(d, VariantInfo("fp32-torchscript", "torchscript", "float32", "model.pt",
                                 params={"method": "torch.jit.trace", **readout, **report["fp32-torchscript"]}),
                  finetuned)

    d = out_dirs["fp32-onnx"]
    t0 = time.perf_counter()
    export_onnx(graph, d / "model.onnx", max_len, params.opset)
    runner = OrtRunner(d / "model.onnx", optimization="disable")
    report["fp32-onnx"] = _checked(reference, runner, seqs, params, max_len, t0, tokenizer.pad_token_id)
    write_variant(d, VariantInfo("fp32-onnx", "onnx", "float32", "model.onnx",
                                 params={"method": "torch.onnx.export(dynamo=True)", "opset": params.opset,
                                         **describe(model), **readout, **report["fp32-onnx"]}), finetuned)
    return report


def _checked(reference: Any, runner: Any, seqs: list[np.ndarray], params: ExportParams, max_len: int,
             started: float, pad_id: int) -> dict[str, Any]:
    p = parity(reference, runner, seqs, pad_id)
    if p.max_abs_diff > params.parity_tolerance:
        raise ExportError(f"parity failed: max |logit diff| {p.max_abs_diff:.2e} > {params.parity_tolerance:.0e}")
    check_dynamic_shapes(runner, reference, max_len)
    return {"parity_max_abs_diff": p.max_abs_diff, "parity_batch": p.batch,
            "export_seconds": round(time.perf_counter() - started, 2)}


def run_quantize(finetuned: Path, fp32_onnx: Path, tokenized: Path, out_dirs: dict[str, Path],
                 params: QuantizeParams, train_seed: int = 42) -> dict[str, Any]:
    """`int8-dynamic`, `int8-static` (calibration method chosen on validation reviews) and `int8-qat`."""
    from pipeline import quantize as q
    from pipeline.variants import read_variant

    model, tokenizer, meta = load_finetuned(finetuned)
    pad = tokenizer.pad_token_id or 0
    arch = read_variant(fp32_onnx).params
    readout = bool(arch.get("cls_readout", False))  # the fp32-onnx export's; static QDQ starts from that file
    train = read_tokenized(tokenized, "train")
    val = read_tokenized(tokenized, "val").iloc[: params.selection_samples]
    calibration = [train["input_ids"].iloc[i] for i in _draw(len(train), params.calibration_samples, train_seed)]
    report: dict[str, Any] = {}

    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        base, fusion = _graph_for_quantization(model, readout, fp32_onnx / "model.onnx", Path(tmp), params, arch,
                                               meta, val["input_ids"].tolist()[:16], pad)
        ffn_width = int(arch["intermediate_size"]) if params.ffn_output_dynamic else None

        t0 = time.perf_counter()
        d = out_dirs["int8-dynamic"]
        d.mkdir(parents=True, exist_ok=True)
        q.quantize_dynamic_onnx(base, d / "model.onnx", params.per_channel, params.reduce_range)
        report["int8-dynamic"] = {"method": "onnxruntime.quantize_dynamic", "per_channel": params.per_channel,
                                  "reduce_range": params.reduce_range,
                                  "fused_graph": params.optimize_graph, **fusion,
                                  **_int8_census(out_dirs["int8-dynamic"], "int8-dynamic"),
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
                                 **_int8_census(out_dirs["int8-static"], "int8-static"),
                                 "build_seconds": round(time.perf_counter() - t0, 2)}
        write_variant(d, VariantInfo("int8-static", "onnx", "int8", "model.onnx", params=report["int8-static"]),
                      finetuned)

        t0 = time.perf_counter()
        report["int8-qat"] = _qat(finetuned, train, calibration, best["method"], Path(tmp), out_dirs["int8-qat"],
                                  params, meta, pad, train_seed, ffn_width, _training_window(meta, tokenizer),
                                  readout)
        report["int8-qat"].update(_int8_census(out_dirs["int8-qat"], "int8-qat"),
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
    return _fused_graph(model, cls_readout, OrtRunner(fp32_onnx, optimization="disable"), "fp32-onnx", tmp,
                        arch["num_heads"], arch["hidden_size"], arch["num_layers"], _max_length(meta), seqs, pad)


def _fused_graph(model: Any, cls_readout: bool, reference: Any, reference_name: str, tmp: Path, num_heads: int,
                 hidden_size: int, num_layers: int, max_len: int, seqs: list[np.ndarray],
                 pad: int) -> tuple[Path, dict[str, Any]]:
    """Export `model` (with the [CLS] readout when asked and possible, see `inference_model`) for onnxruntime's
    BERT fusion, fuse it, and check it against `reference` on real reviews.

    A readout last layer does not fuse (its single query is left as plain MatMuls), so one fewer of the
    `num_layers` attention blocks is expected then."""
    from pipeline.quantize import QuantizeError, optimize_for_quantization

    graph, readout = inference_model(model, cls_readout)
    num_layers -= int(readout["cls_readout"])
    raw, fused = tmp / "for-fusion.onnx", tmp / "fused.onnx"
    export_onnx_for_fusion(graph, raw, max_len)
    counts = optimize_for_quantization(raw, fused, num_heads, hidden_size)
    p = parity(reference, OrtRunner(fused, optimization="disable"), seqs, pad)
    if p.max_abs_diff > FUSION_TOLERANCE:
        raise QuantizeError(f"fused graph disagrees with {reference_name}: max |logit diff| {p.max_abs_diff:.2e}")
    if counts.get("Attention", 0) != num_layers:
        log.warning("onnxruntime fused %d of %d attention blocks; the rest are quantized as plain MatMuls",
                    counts.get("Attention", 0), num_layers)
    return fused, {**readout, "fusions": counts, "fused_attention": counts.get("Attention", 0),
                   "fused_parity_max_abs_diff": p.max_abs_diff}


def _draw(rows: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct row indices (all rows if fewer), the same for the same seed."""
    return np.random.default_rng(seed).choice(rows, size=min(count, rows), replace=False)


def _int8_census(directory: Path, name: str) -> dict[str, int]:
    """The variant's matrix products by arithmetic; an INT8 build that quantized none of them is an error."""
    from pipeline.quantize import QuantizeError, matmul_census

    counts = matmul_census(directory / "model.onnx")
    if counts["int8_matmuls"] == 0:
        raise QuantizeError(f"{name}: no matrix product was quantized ({counts})")
    return counts


def _static_with_selection(base: Path, tmp: Path, calibration: list[np.ndarray], val: Any, params: QuantizeParams,
                           pad: int, ffn_width: int | None) -> dict[str, Any]:
    """Build one static model per calibration method; keep the most accurate on validation reviews.

    With a single method there is nothing to choose, so no validation pass is spent on it (`scores` is empty).
    """
    from pipeline.quantize import quantize_static_onnx_methods

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
    from pipeline.quantize import qat_finetune, quantize_static_onnx

    model, _, _ = load_finetuned(finetuned)
    model.train()
    idx = _draw(len(train), params.qat_train_samples, seed + 1)
    reviews = [train["input_ids"].iloc[i] for i in idx]
    if window is not None:
        reviews = [window(ids) for ids in reviews]
    result = qat_finetune(model, reviews, train["label"].to_numpy()[idx],
                          params.qat_epochs, params.qat_batch_size, params.qat_lr, seed, pad, ffn_width,
                          params.reduce_range, params.qat_distillation)
    fp32 = tmp / "qat-fp32.onnx"
    graph, readout = inference_model(model, cls_readout)  # qat_finetune leaves the model in eval mode
    export_onnx(graph, fp32, _max_length(meta))
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


def run_prune(finetuned: Path, tokenized: Path, out: Path, params: PruneParams, quantize: QuantizeParams,
              train_seed: int = 42, cls_readout: bool = True) -> dict[str, Any]:
    """`int8-pruned`: the finetuned model with whole heads and FFN neurons removed (see `pipeline.prune`),
    exported with the [CLS] readout (`export.cls_readout`), fused by onnxruntime and quantized like
    `int8-dynamic`. Disabled, it is written as a skipped variant."""
    import torch

    from pipeline import quantize as q
    from pipeline.prune import prune_encoder
    from pipeline.variants import pad_batch

    name = "int8-pruned"
    if not params.enabled:
        reason = "prune.enabled is false"
        log.warning("%s skipped: %s", name, reason)
        write_variant(out, VariantInfo(name, "onnx", "int8", None, "skipped", reason, to_dict(params)), finetuned)
        return {"status": "skipped", "reason": reason}
    started = time.perf_counter()
    model, tokenizer, meta = load_finetuned(finetuned)
    pad = tokenizer.pad_token_id or 0
    train = read_tokenized(tokenized, "train")
    window = _training_window(meta, tokenizer)
    seqs = [train["input_ids"].iloc[i] for i in _draw(len(train), params.calibration_samples, train_seed + 2)]
    seqs = [window(s) for s in seqs] if window is not None else seqs
    seqs.sort(key=len)  # batches of similar length: little padding to run through the model
    step = params.calibration_batch_size
    batches = [tuple(torch.from_numpy(a) for a in pad_batch(seqs[i : i + step], pad))
               for i in range(0, len(seqs), step)]
    student, report = prune_encoder(model, batches, params.heads, params.ffn_width, params.damp)
    heads, head_dim = report["heads"], int(model.config.hidden_size) // int(model.config.num_attention_heads)

    with tempfile.TemporaryDirectory(prefix="prune-") as tmp:
        check = read_tokenized(tokenized, "val")["input_ids"].tolist()[:16]
        fused, fusion = _fused_graph(student, cls_readout, eager_runner(student), "the pruned model", Path(tmp),
                                     heads, heads * head_dim, int(model.config.num_hidden_layers),
                                     _max_length(meta), check, pad)
        out.mkdir(parents=True, exist_ok=True)
        q.quantize_dynamic_onnx(fused, out / "model.onnx", quantize.per_channel, quantize.reduce_range)
    census = _int8_census(out, name)
    info = {"method": "structured pruning (OBS selection + least-squares repair) + onnxruntime.quantize_dynamic",
            **to_dict(params), "per_channel": quantize.per_channel, "reduce_range": quantize.reduce_range,
            **fusion, **report, **census,
            "build_seconds": round(time.perf_counter() - started, 2)}
    write_variant(out, VariantInfo(name, "onnx", "int8", "model.onnx", params=info), finetuned)
    return info


def run_tensorrt(finetuned: Path, fp32_onnx: Path, int8_static: Path, out_dirs: dict[str, Path],
                 params: TensorRTParams, max_seq: int) -> dict[str, Any]:
    """Build `tensorrt-fp16`/`tensorrt-int8` where possible; otherwise write the skip record and say why."""
    from pipeline.tensorrt import availability, build_engine, profile_shapes

    shapes = profile_shapes(params.min_batch, params.opt_batch, params.max_batch, params.min_seq,
                            min(params.opt_seq, max_seq), max_seq)
    ok, reason = availability()
    report: dict[str, Any] = {}
    sources = {"tensorrt-fp16": (fp32_onnx, "fp16"), "tensorrt-int8": (int8_static, "int8")}
    for name, (src, precision) in sources.items():
        d = out_dirs[name]
        base = {"precision": precision, "source": src.name, "profile": shapes.__dict__, **to_dict(params)}
        if not ok:
            log.warning("%s skipped: %s", name, reason)
            write_variant(d, VariantInfo(name, "tensorrt", precision, None, "skipped", reason, base), finetuned)
            report[name] = {"status": "skipped", "reason": reason}
            continue
        t0 = time.perf_counter()
        info = build_engine(src / "model.onnx", d / "model.engine", shapes, precision, params.workspace_mb)
        base.update(info, build_seconds=round(time.perf_counter() - t0, 2))
        write_variant(d, VariantInfo(name, "tensorrt", precision, "model.engine", params=base), finetuned)
        report[name] = {"status": "ok"}
    return report
