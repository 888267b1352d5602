"""The `benchmark` stage's work: measure every variant, write metrics/plots/report, log one MLflow run per variant.

Rerun alone on chosen variants with `python -m pipeline.evaluation.benchmark --variants int8-static,fp32-onnx`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.io import read_json, write_json
from pipeline.core.machine import Choice, machine_info, resolved_threads
from pipeline.core.params import BenchmarkParams, Params, to_dict
from pipeline.evaluation.charts import latency_chart, pareto_chart, plot_rows
from pipeline.evaluation.latency import (
    Apart,
    Candidate,
    candidates,
    latency_inputs,
    measure,
    peak_rss_of_each,
    speedup,
    throughput_batches,
)
from pipeline.evaluation.report import markdown_table, pair_lines, speedup_sources, target_lines, write_report
from pipeline.runtimes.base import Runner
from pipeline.runtimes.catalog import REFERENCE, TIMING_ROWS, directories
from pipeline.runtimes.record import VARIANT_FILE
from pipeline.runtimes.registry import load_runner
from pipeline.selection import SPEED_PAIRS, PairVerdict, qat_verdicts, servable_int8, static_verdicts

if TYPE_CHECKING:
    from pipeline.core.parent_run import RunContext

log = logging.getLogger(__name__)


def run_benchmark(*, finetuned: Path, variant_dirs: dict[str, Path], tokenized: Path, params: BenchmarkParams,
                  bf16: Choice, accuracy: dict[str, dict[str, Any]] | None = None,
                  built: dict[str, Path] | None = None) -> dict[str, Any]:
    """Measure every candidate; skipped variants stay in the table with their reason. `bf16`: how the caller
    resolved `benchmark.bf16_row` (whether the FP32 model is also timed under bf16 autocast); `built`: every built
    variant, where `variant_dirs` is a choice of them (whether any has the readout decides the readout row)."""
    from tqdm.auto import tqdm

    from pipeline.data.tokens import read_tokenized

    threads = resolved_threads(params.threads)
    import torch

    torch.set_num_threads(threads)
    seqs = read_tokenized(tokenized, "test")["input_ids"].tolist()
    from pipeline.modeling import saved_pad_id

    pad = saved_pad_id(finetuned)
    lat_inputs = latency_inputs(seqs, params.seq_len, params.latency_reviews, pad)
    tp_batches = throughput_batches(seqs, params.batch_size, params.throughput_batches, pad)
    log.info("benchmark.bf16_row: %s", bf16.tag())
    cands = candidates(finetuned, variant_dirs, bf16.value, built)
    from pipeline.runtimes.readout import ReadoutError

    runners: dict[str, Runner] = {}
    for c in cands:
        if c.status == "ok":
            try:
                runners[c.name] = load_runner(c.directory, threads, **c.options)
            except ReadoutError as exc:  # the readout row, for a head that reads every position
                c.status, c.reason = "skipped", str(exc)
    total = params.rounds * len(runners)
    with tqdm(total=total, desc="benchmark", unit="run") as bar:
        timings = measure(runners, lat_inputs, tp_batches, params, progress=lambda _: bar.update(1),
                          apart=apart_rows(list(runners), params.apart_after))
    for name, t in timings.items():
        if t["rounds"] < params.rounds:
            log.info("%s: timed in %d of %d rounds, then left out: clearly slower than every servable INT8 variant",
                     name, t["rounds"], params.rounds)
    ok = [c for c in cands if c.status == "ok"]
    rss = peak_rss_of_each({c.name: (c.directory, c.options) for c in ok}, tp_batches[0], threads) \
        if params.memory else {}
    results = result_rows(cands, timings, rss, accuracy or {})
    return {"variants": results, "machine": machine_info(threads),
            # every batch-1 sample by round, so each speed-up interval can be recomputed (`latency.speedup`)
            "latency_rounds_ms": {name: t["latency_rounds_ms"] for name, t in timings.items()},
            "settings": {"seq_len": params.seq_len, "batch_size": params.batch_size, "rounds": params.rounds,
                         "apart_after": params.apart_after,
                         "iterations": params.iterations, "warmup": params.warmup, "bf16_row": bf16.value,
                         "latency_samples": timings[REFERENCE]["latency_samples"],  # as `measure` took them
                         "latency_inputs": len(lat_inputs),
                         "bf16_row_choice": bf16.tag()}}


def apart_rows(names: list[str], after_rounds: int | None) -> Apart | None:
    """Which timed rows may stop early (`latency.Apart`): those the package stage never serves, against the
    servable INT8 variants it chooses among; FP32 eager runs every round. None where `benchmark.apart_after` is
    null."""
    if after_rounds is None:
        return None
    int8 = frozenset(filter(servable_int8, names))
    return Apart(rows=frozenset(names) - int8 - {REFERENCE}, against=int8, after_rounds=after_rounds)


def result_rows(cands: list[Candidate], timings: dict[str, dict[str, Any]], rss: dict[str, float],
                accuracy: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The benchmark's row of every candidate, in their order: status and reason; a measured one's timings (the
    latency samples by round left to the result's own key), speed-up over the reference with its interval, peak RSS
    where probed; the accuracy (and its paired standard error against FP32), size and agreement evaluate recorded
    (`accuracy`); and the paired batch-1 interval of each pair of `SPEED_PAIRS` whose two variants were timed (a
    QAT variant against its runtime's post-training one, a static-scale recipe against int8-dynamic)."""
    results: dict[str, dict[str, Any]] = {}
    for c in cands:
        entry: dict[str, Any] = {"status": c.status, "reason": c.reason}
        if c.status == "ok":
            entry.update(_measured(c, timings, rss))
        acc = accuracy.get(c.name, {})  # the timing rows of the reference's weights have none of their own
        for key in ("accuracy", "accuracy_delta_se_pt", "size_mb", "agreement_with_fp32"):
            if key in acc:
                entry[key] = acc[key]
        results[c.name] = entry
    for name, baseline in SPEED_PAIRS:  # paired by round, as each row's speed-up over FP32 eager
        if name in timings and baseline in timings:
            pair = speedup(timings[baseline], timings[name])
            results[name]["b1_vs_baseline_low"], results[name]["b1_vs_baseline_high"] = pair.low, pair.high
    return results


def _measured(c: Candidate, timings: dict[str, dict[str, Any]], rss: dict[str, float]) -> dict[str, Any]:
    """What a measured candidate's row holds beyond its status: readout, weight format, timings, speed-up, RSS."""
    entry: dict[str, Any] = {"cls_readout": c.cls_readout}
    if c.weight_format is not None:
        entry["weight_format"] = c.weight_format
    gain = speedup(timings[REFERENCE], timings[c.name])
    entry.update({k: v for k, v in timings[c.name].items() if k != "latency_rounds_ms"})
    entry["speedup_p50_vs_fp32_eager"] = gain.p50
    if c.name != REFERENCE:
        entry["speedup_p50_low"], entry["speedup_p50_high"] = gain.low, gain.high
    if c.name in rss:
        entry["peak_rss_mb"] = rss[c.name]
    return entry


def main(argv: list[str] | None = None) -> None:
    """Rerun the benchmark alone: `python -m pipeline.evaluation.benchmark --variants int8-static,fp32-onnx`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variants-root", type=Path, default=Path("models/variants"))
    parser.add_argument("--finetuned", type=Path, default=Path("models/finetuned"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_cli.json"))
    args = parser.parse_args(argv)
    from pipeline.core.params import load_params, resolve_auto
    from pipeline.core.stage import setup_logging

    setup_logging()
    all_params = load_params(args.params)
    params = all_params.benchmark
    wanted = [v for v in args.variants.split(",") if v]
    dirs = {name: d for name, d in directories(args.variants_root).items() if (d / VARIANT_FILE).is_file()}
    unknown = [v for v in wanted if v not in dirs and v not in (REFERENCE, *TIMING_ROWS)]
    if unknown:
        raise SystemExit(f"unknown or unbuilt variant(s) {unknown}; built: {sorted(dirs)}")
    chosen = {k: v for k, v in dirs.items() if k in wanted} if wanted else dirs
    result = run_benchmark(finetuned=args.finetuned, variant_dirs=chosen, tokenized=args.tokenized, params=params,
                           bf16=resolve_auto(all_params).bf16_row, built=dirs)
    write_json(args.out, result)
    print(markdown_table(result["variants"], params.batch_size))


#: The benchmark's metrics per variant run; `throughput_b32` is measured at `benchmark.batch_size` (`latency.measure`).
METRIC_KEYS = ("p50_ms_b1", "p95_ms_b1", "p99_ms_b1", "throughput_b32", "peak_rss_mb", "speedup_p50_vs_fp32_eager",
               "speedup_p50_low", "speedup_p50_high", "accuracy", "size_mb")
#: The measurements linked to each variant's MLflow model (evaluate linked its accuracy, agreement and size).
MODEL_METRIC_KEYS = ("p50_ms_b1", "p95_ms_b1", "p99_ms_b1", "throughput_b32", "peak_rss_mb",
                     "speedup_p50_vs_fp32_eager", "speedup_p50_low", "speedup_p50_high")
#: The benchmark table on the pipeline's parent run (`mlflow.log_table`).
TABLE_FILE = "comparison/benchmark_table.json"


def model_id_of(accuracy: dict[str, dict[str, Any]], name: str) -> str | None:
    """The MLflow model evaluate logged for row `name`; none for the timing rows (bf16 autocast, eager readout),
    which time the FP32 model under another runtime setting (their numbers are not that model's)."""
    return (accuracy.get(name) or {}).get("model_id") if name not in TIMING_ROWS else None


def table_rows(variants: dict[str, Any], accuracy: dict[str, dict[str, Any]], measured_by: str) -> list[dict[str, Any]]:
    """One row per benchmark row: status, latency, throughput, speed-up, accuracy, size and the MLflow model it
    belongs to; `measured_by` (the pipeline run) tells apart rows that MLflow appends to an existing table."""
    rows = []
    for name, entry in variants.items():
        row: dict[str, Any] = {"variant": name, "status": entry["status"]}
        row.update({k: entry.get(k) for k in METRIC_KEYS})
        row["model_id"] = model_id_of(accuracy, name)
        row["reason"] = entry.get("reason", "")
        row["measured_by"] = measured_by
        rows.append(row)
    return rows


def run_benchmark_stage(*, finetuned: Path, variants_root: Path, tokenized: Path, accuracy_file: Path,
                        metrics_path: Path, plot_data: Path, report: Path, all_params: Params,
                        bf16: Choice, run_context: RunContext) -> dict[str, Any]:
    """Benchmark every registered variant; `metrics/benchmark.json` holds one object per variant. Each variant's
    timings are linked to its MLflow model (the evaluate stage logged it and wrote its id into
    `metrics/variants.json`), and the whole table goes on the execution's parent run (`run_context`)."""
    from pipeline.core.model_registry import model_exists
    from pipeline.core.parent_run import log_parent_artifact, log_parent_summary, log_parent_table
    from pipeline.core.tracking import stage_run

    params = all_params.benchmark
    accuracy = read_json(accuracy_file)
    result = run_benchmark(finetuned=finetuned, variant_dirs=directories(variants_root), tokenized=tokenized,
                           params=params, bf16=bf16, accuracy=accuracy)
    variants = result["variants"]
    write_json(metrics_path, variants)
    write_json(metrics_path.with_name("benchmark_machine.json"), {**result["machine"], **result["settings"]})
    plot_rows(variants, plot_data)
    write_json(report.with_name("latency_rounds.json"), result["latency_rounds_ms"])
    chart, pareto = report.with_name("variants_latency.png"), report.with_name("variants_pareto.png")
    latency_chart(variants, chart, params.batch_size)
    pareto_chart(variants, all_params.targets, pareto)
    write_report(result, chart, report, all_params.targets, pareto)
    for line in (*target_lines(variants, all_params.targets),
                 *pair_lines(variants, all_params.targets, params.batch_size)):
        log.info(line.replace("**", ""))
    for name, entry in variants.items():
        with stage_run(run_context, "benchmark", run_name=f"bench-{name}", tags={"variant": name}) as run:
            run.log_params({"variant": name, **to_dict(params), "cpu": result["machine"]["cpu"]})
            run.set_tags({"status": entry["status"], "reason": entry["reason"]})
            run.log_metrics({k: entry[k] for k in METRIC_KEYS if entry.get(k) is not None})
            model_id = model_id_of(accuracy, name)
            if entry["status"] == "ok" and model_exists(model_id, tracking_uri=run_context.tracking_uri):
                run.log_metrics({k: entry[k] for k in MODEL_METRIC_KEYS if entry.get(k) is not None},
                                model_id=model_id)
            elif model_id:
                log.warning("%s: MLflow model %s is not in this tracking store; timings not linked to it",
                            name, model_id)
    log_parent_table(run_context, rows=table_rows(variants, accuracy, run_context.run_id), artifact_file=TABLE_FILE)
    pairs = {**pair_metrics("qat", qat_verdicts(variants, all_params.targets)),
             **pair_metrics("static", static_verdicts(variants, all_params.targets))}
    sources = speedup_sources(variants, result["latency_rounds_ms"])  # each step over the rounds its rows share
    log_parent_summary(run_context, metrics={**{f"speedup_source/{s['to']}_vs_{s['from']}": s["factor"]
                                                for s in sources}, **pairs}, tags={})
    for f in (report, chart, pareto, metrics_path):
        log_parent_artifact(run_context, f, artifact_path="comparison")
    return result


def pair_metrics(prefix: str, verdicts: list[PairVerdict]) -> dict[str, float]:
    """The parent run's metrics of each verdict, `<prefix>/<variant>/<what>`: the accuracy difference and its
    standard error, the batch-1 ratio to the baseline with its paired interval, the throughput ratio where judged
    (`b32_vs_*`, named after `throughput_b32`) and the verdict's flags."""
    return {f"{prefix}/{q.variant}/{k}": value for q in verdicts
            for k, value in (("delta_pt", q.delta_pt), (f"b1_vs_{q.baseline}", q.b1),
                             (f"b1_vs_{q.baseline}_low", q.b1_low), (f"b1_vs_{q.baseline}_high", q.b1_high),
                             (f"b32_vs_{q.baseline}", q.batched), ("met", float(q.met)),
                             ("within_noise", float(q.within_noise)), ("delta_se_pt", q.delta_se_pt),
                             ("accuracy_within_noise", float(q.accuracy_within_noise)),
                             ("could_flip", float(q.could_flip))) if value is not None}


if __name__ == "__main__":
    main()
