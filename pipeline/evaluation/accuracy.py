"""The `evaluate` stage's work: every variant scored the same way (test accuracy, agreement with FP32, size)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.errors import UserError
from pipeline.core.io import read_predictions, save_figure
from pipeline.core.machine import resolved_threads
from pipeline.core.params import EvaluateParams, PackageParams, Params, TargetsParams, flatten
from pipeline.data.tokens import read_tokenized
from pipeline.modeling import saved_pad_id
from pipeline.runtimes.base import Runtime, predict_logits
from pipeline.runtimes.catalog import REFERENCE, spec
from pipeline.runtimes.fp32_linear import fp32_linear_on
from pipeline.runtimes.record import VariantError, VariantInfo, read_variant, size_mb, variant_batching
from pipeline.runtimes.registry import load_runner
from pipeline.selection import TIE_P_VALUE, int8_candidates, mcnemar_p, most_accurate, quantization_verdicts

if TYPE_CHECKING:
    from pipeline.core.parent_run import RunContext

log = logging.getLogger(__name__)


def score_variants(finetuned: Path, variant_dirs: dict[str, Path], tokenized: Path, params: EvaluateParams,
                   reference_predictions: Path | None = None, *,
                   targets: TargetsParams) -> dict[str, dict[str, Any]]:
    """One entry per variant (and the FP32 PyTorch reference): accuracy, size_mb, agreement, status.

    With `reference_predictions` (the finetune stage's test logits, checked to score exactly this test
    split in batches of `params.batch_size`) the FP32 reference is not scored a second time; its `scored_by`
    says which stage scored it.
    """
    test = read_tokenized(tokenized, "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    pad = saved_pad_id(finetuned)  # every variant carries the finetuned model's tokenizer
    reference, ref_pred = reference_row(finetuned, seqs, labels, params, reference_predictions, pad)
    results: dict[str, dict[str, Any]] = {REFERENCE: reference}
    correct: dict[str, np.ndarray] = {}
    for name, directory in variant_dirs.items():
        info = read_variant(directory)
        entry: dict[str, Any] = {"status": info.status, "reason": info.reason, "format": info.format,
                                 "dtype": info.dtype}
        if info.status != "ok":
            results[name] = entry
            continue
        t0 = time.perf_counter()
        try:
            runner, callers = runner_for_test_split(directory, params.threads, info)
            pred = predict_logits(runner, seqs, params.batch_size, pad, progress=name, callers=callers).argmax(-1)
        except UserError as exc:  # a variant the user can act on (missing files, a runtime not installed)
            raise VariantError(f"variant {name} failed to run on the test split: {exc}") from exc
        except Exception as exc:  # a fault in the code: its traceback stays, named by the variant
            exc.add_note(f"variant {name} failed to run on the test split")
            raise
        entry["scored_with"] = {**runner.describe(), "concurrent_calls": callers}
        correct[name] = pred == labels
        entry.update(
            accuracy=float((pred == labels).mean()),
            accuracy_delta_se_pt=paired_se_pt(correct[name], ref_pred == labels),
            agreement_with_fp32=float((pred == ref_pred).mean()),
            size_mb=round(size_mb(directory, info), 3),
            eval_seconds=round(time.perf_counter() - t0, 2),
            test_samples=len(labels),
        )
        results[name] = entry
        log.info("%s: accuracy %.4f, agreement %.4f, %.1f MB", name, entry["accuracy"],
                 entry["agreement_with_fp32"], entry["size_mb"])
    fp32 = results[REFERENCE]["accuracy"]
    for entry in results.values():
        if entry.get("accuracy") is not None:
            entry["accuracy_delta_pt"] = round(100 * (entry["accuracy"] - fp32), 3)
    paired_with_most_accurate(results, correct, targets)  # the profile's targets: which variants are candidates
    paired_qat_with_static(results, correct)
    return results


def paired_se_pt(correct: np.ndarray, reference_correct: np.ndarray) -> float:
    """The standard error, in points, of an accuracy difference to the reference on the same reviews: it comes from
    the reviews only one of the two gets right (`b` only the reference, `c` only this one). Agresti and Min's
    adjustment (half a review added to each cell of the paired 2x2 table) keeps it honest where few or no reviews
    disagree: no disagreement in 1,500 reviews is about 0.07 pt, not a certainty. 0 for an empty split."""
    n = len(correct)
    if n == 0:
        return 0.0
    b = float((reference_correct & ~correct).sum()) + 0.5
    c = float((correct & ~reference_correct).sum()) + 0.5
    m = n + 2.0
    return round(100 * float(np.sqrt(max(b + c - (c - b) ** 2 / m, 0.0))) / m, 4)


def reference_row(finetuned: Path, seqs: list[np.ndarray], labels: np.ndarray, params: EvaluateParams,
                  reference_predictions: Path | None, pad: int) -> tuple[dict[str, Any], np.ndarray]:
    """The FP32 PyTorch reference's entry and its predicted labels on the test split (`seqs`, `labels`): from the
    finetune stage's test logits (`reference_predictions`) where they were scored on the CPU in batches of
    `params.batch_size` padded with the tokenizer's id, with the kernel this CPU picks for FP32 `Linear` layers
    (`fp32_linear_on`; the same batches, padding and kernel, so the same logits), else scored here. Either way
    `scored_by` names the stage."""
    t0 = time.perf_counter()
    ref_logits, scored_by, seconds, kernel = None, "evaluate", 0.0, fp32_linear_on("cpu")
    if reference_predictions is not None:
        try:
            logits, saved = read_predictions(reference_predictions, seqs, labels)
        except (FileNotFoundError, ValueError) as exc:
            raise VariantError(str(exc)) from exc
        here = {"batch_size": params.batch_size, "pad_id": pad, "device": "cpu", "fp32_linear": kernel}
        differ = {k: saved.get(k) for k, v in here.items() if saved.get(k) != v}
        if not differ:  # the same batches, padding, device and kernel: the same logits
            ref_logits, scored_by, seconds = logits, "finetune", float(saved.get("seconds", 0.0))
            log.info("%s: test logits reused from %s (scored by the finetune stage)", REFERENCE,
                     reference_predictions)
        else:
            log.info("%s: %s was scored with %s, evaluate uses %s: scoring FP32 again", REFERENCE,
                     reference_predictions, differ, {k: here[k] for k in differ})
    if ref_logits is None:
        ref_logits = predict_logits(load_runner(finetuned, params.threads), seqs, params.batch_size, pad,
                                    progress=REFERENCE)
        seconds = time.perf_counter() - t0
    ref_pred = ref_logits.argmax(-1)
    entry: dict[str, Any] = {
        "status": "ok", "reason": "", "format": "pytorch", "dtype": "float32",
        "accuracy": float((ref_pred == labels).mean()), "agreement_with_fp32": 1.0,
        "size_mb": round((finetuned / "model.safetensors").stat().st_size / 1e6, 3),
        "eval_seconds": round(seconds, 2), "test_samples": len(labels), "scored_by": scored_by,
        "fp32_linear": kernel,
    }
    return entry, ref_pred


#: Formats whose runner can run calls from several threads at the same time (`one_call_a_thread` says how).
PARALLEL_CALL_FORMATS = ("onnx", "openvino")


def one_call_a_thread(fmt: str, cores: int) -> tuple[int, dict[str, Any]]:
    """The threads and options of a runner of format `fmt` (one of `PARALLEL_CALL_FORMATS`) that runs `cores`
    one-thread calls side by side. An onnxruntime session runs concurrent calls as they come: one intra-op thread.
    OpenVINO's compiled model runs one call a stream: `cores` threads split into `cores` streams (on its served one
    stream, callers would only take turns; docs/batch-invariance.md#openvino-int8-too)."""
    return (cores, {"streams": cores}) if fmt == "openvino" else (1, {})


def runner_for_test_split(directory: Path, threads: int | None,
                          info: VariantInfo | None = None) -> tuple[Runtime, int]:
    """The runner that scores a variant's test split, and how many threads call it at once.

    A variant scored one review per call (`batching: rows`: its activation scales span the batch) runs small
    matrix products that a second intra-op thread barely speeds up; where its runtime can run concurrent calls side
    by side (`PARALLEL_CALL_FORMATS`), the same cores score more reviews as that many one-thread calls at once (each
    review is still scored alone, so the logits do not change: tests/unit/evaluation/test_accuracy.py compares
    them with the served runner's). Other variants keep one call with every thread."""
    info = info or read_variant(directory)  # `info`: the record where the caller has read it already
    cores = resolved_threads(threads)
    if (cores < 2 or variant_batching(directory, info)["served_batching"] != "rows"
            or info.format not in PARALLEL_CALL_FORMATS):
        return load_runner(directory, threads), 1
    runner_threads, options = one_call_a_thread(info.format, cores)
    return load_runner(directory, runner_threads, **options), cores


def paired_with_most_accurate(results: dict[str, dict[str, Any]], correct: dict[str, np.ndarray],
                              targets: TargetsParams) -> None:
    """Each INT8 candidate of the package stage's choice (`selection.int8_candidates`) compared with the most
    accurate one on the same reviews: how many only the most accurate gets right, how many only this one, and the
    exact McNemar p-value (`paired_*` fields), so the package stage can tell a real accuracy difference from one
    the test set cannot resolve."""
    candidates = int8_candidates(results, targets)
    best = most_accurate(candidates)
    if best is None:
        return
    for name in candidates:
        only_best, only_this, p = discordant(correct[best], correct[name])
        results[name].update(paired_reference=best, paired_only_reference_right=only_best,
                             paired_only_this_right=only_this, paired_p_value=p)


def paired_qat_with_static(results: dict[str, dict[str, Any]], correct: dict[str, np.ndarray]) -> None:
    """int8-qat against int8-static on the same reviews, where both were scored: how many only static gets right,
    how many only QAT, and the exact McNemar p-value (`vs_static_*` fields of int8-qat's entry), so the target "QAT
    at least matches static" is not called missed for a difference the test set cannot resolve."""
    if "int8-static" not in correct or "int8-qat" not in correct:
        return
    only_static, only_qat, p = discordant(correct["int8-static"], correct["int8-qat"])
    results["int8-qat"].update(vs_static_only_static_right=only_static, vs_static_only_qat_right=only_qat,
                               vs_static_p_value=p)


def discordant(first: np.ndarray, second: np.ndarray) -> tuple[int, int, float]:
    """Two variants' right answers on the same reviews: how many only the first gets right, how many only the
    second, and the exact McNemar p-value of that split (`selection.mcnemar_p`), unrounded: the package stage
    compares it with its tie threshold, and a rounded 0.04998 would read as 0.05 (shown rounded where printed)."""
    only_first, only_second = int((first & ~second).sum()), int((second & ~first).sum())
    return only_first, only_second, mcnemar_p(only_first, only_second)


def check_targets(results: dict[str, dict[str, Any]], targets: TargetsParams) -> list[str]:
    """The quantization targets (`pipeline.selection.quantization_verdicts`) as plain sentences for the log."""
    lines = []
    for v in quantization_verdicts(results, targets):
        verdict = "met" if v.met else "MISSED"
        if v.target == "accuracy_loss_pt":
            lines.append(f"{v.variant}: accuracy loss {v.value:.2f} pt vs FP32 ({verdict}: <= {v.bound} pt)")
        elif v.target == "size_share":
            lines.append(f"{v.variant}: size {v.value:.0%} of fp32-onnx ({verdict}: <= {v.bound:.0%})")
        elif not v.unresolved:
            lines.append(f"int8-qat {v.value:.4f} vs int8-static {v.bound:.4f} "
                         f"({verdict}: QAT at least matches static)")
        else:
            lines.append(f"int8-qat {v.value:.4f} vs int8-static {v.bound:.4f} (a tie the test set cannot resolve: "
                         f"exact McNemar p = {v.tie_p_value:.2f} >= {TIE_P_VALUE} on the reviews only one of them gets "
                         "right; target: QAT at least matches static)")
    return lines


#: The scores linked to each variant's MLflow model (the benchmark stage adds its timings).
MODEL_METRICS = ("accuracy", "accuracy_delta_pt", "accuracy_delta_se_pt", "agreement_with_fp32", "size_mb")


def log_variant_runs(results: dict[str, dict[str, Any]], *, variant_dirs: dict[str, Path], finetuned: Path,
                     params: EvaluateParams, run_context: RunContext, serving: PackageParams) -> None:
    """One MLflow child run per variant under the execution's parent run (`run_context`), and one MLflow
    LoggedModel per built variant with its scores linked to it, so the experiment's models view lines the
    variants up.

    Every servable variant (`spec(name).servable`: the torchscript, onnx and openvino formats, which the serving
    handler runs on CPU) is logged with its directory (model file, tokenizer, label map, record) as a pyfunc model
    around `ContractPredictor` (`pipeline.deployment.mlflow_model.log_variant_model`), which checks and cuts texts
    and uses threads as the served `.mar` does (`serving`). A servable variant larger than
    `params.artifact_max_mb`, the FP32 reference (its weights are the finetune run's artifacts) and variants only a
    GPU runs (tensorrt) are logged as external models: their metrics line up, their files stay where they are.
    Each entry of `results` gains the model's id and URI (`model_id`, `model_uri`, `model_files`)."""
    from pipeline.core.tracking import stage_run
    from pipeline.deployment.mlflow_model import log_variant_model, model_labels

    dirs = {REFERENCE: finetuned, **variant_dirs}
    for name, entry in results.items():
        with stage_run(run_context, "evaluate", run_name=name,
                       tags={"variant": name, "pipeline.kind": "variant"}) as run:
            directory = dirs[name]
            info_params = read_variant(directory).params if name != REFERENCE else {}
            run.log_params({"variant": name, "format": entry["format"], "dtype": entry["dtype"], **info_params})
            run.set_tags({"status": entry["status"], "reason": entry["reason"],
                          **({"scored_by": entry["scored_by"]} if "scored_by" in entry else {})})
            if entry["status"] != "ok":
                run.log_metrics(entry)
                continue
            model_params = {"variant": name, **flatten(info_params)}
            if spec(name).servable and entry["size_mb"] <= params.artifact_max_mb:
                ref = log_variant_model(run, name, directory, serving, model_params)
            else:
                ref = run.log_external_model(name, directory, model_params, *model_labels(name))
                run.set_tags({"artifact_pointer": Path(directory).resolve()})
            entry.update(ref.to_dict())
            run.log_metrics({k: entry[k] for k in MODEL_METRICS if k in entry}, model_id=ref.model_id)
            # the bookkeeping (timings, counts) stays on the run, out of the models view's columns
            run.log_metrics({k: v for k, v in entry.items() if k not in MODEL_METRICS}, run_only=True)


def accuracy_bars(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Accuracy and size per variant, side by side."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to touch

    names = [n for n, e in results.items() if e.get("status") == "ok"]
    fig = Figure(figsize=(10, 3.6), dpi=110)
    axes = fig.subplots(1, 2)
    acc = np.array([results[n]["accuracy"] for n in names]) * 100
    axes[0].barh(names, acc, color="#4c72b0")
    axes[0].set_xlim(max(0.0, acc.min() - 5), min(100.0, acc.max() + 1))
    axes[0].set_xlabel("test accuracy (%)")
    axes[1].barh(names, [results[n]["size_mb"] for n in names], color="#dd8452")
    axes[1].set_xlabel("size on disk (MB)")
    axes[1].set_yticks([])
    skipped = [n for n, e in results.items() if e.get("status") != "ok"]
    if skipped:
        fig.suptitle("skipped: " + ", ".join(skipped), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def run_evaluate_stage(*, finetuned: Path, variants_root: Path, tokenized: Path, reference_predictions: Path | None,
                       metrics_path: Path, plot: Path, params: Params,
                       run_context: RunContext) -> dict[str, dict[str, Any]]:
    """Score every registered variant, write `metrics/variants.json` and the chart, state the targets, and log
    one MLflow run and one MLflow model per variant under the execution's parent run (`run_context`), which
    also gets the file and the chart."""
    from pipeline.core.io import write_json
    from pipeline.core.parent_run import log_parent_artifact
    from pipeline.runtimes.catalog import directories

    variants = directories(variants_root)
    results = score_variants(finetuned, variants, tokenized, params.evaluate, reference_predictions,
                             targets=params.targets)
    accuracy_bars(results, plot)
    for line in check_targets(results, params.targets):
        log.info(line)
    log_variant_runs(results, variant_dirs=variants, finetuned=finetuned, params=params.evaluate,
                     run_context=run_context, serving=params.package)
    write_json(metrics_path, results)  # with each variant's MLflow model id, which benchmark and package link to
    log_parent_artifact(run_context, metrics_path)
    log_parent_artifact(run_context, plot)
    return results
