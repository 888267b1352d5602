"""The `benchmark` stage: measure, write metrics/plots/report, and log one MLflow run per variant."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.bench import run_benchmark
from pipeline.config import BenchmarkParams, MlflowParams, to_dict
from pipeline.io import read_json, write_json
from pipeline.report import latency_chart, plot_rows, target_lines, write_report

log = logging.getLogger(__name__)

METRIC_KEYS = ("p50_ms_b1", "p95_ms_b1", "p99_ms_b1", "throughput_b32", "peak_rss_mb", "speedup_p50_vs_fp32_eager",
               "speedup_p50_low", "speedup_p50_high", "accuracy", "size_mb")


def run_benchmark_stage(finetuned: Path, variant_dirs: dict[str, Path], tokenized: Path, accuracy_file: Path,
                        metrics_path: Path, plot_data: Path, report: Path, params: BenchmarkParams,
                        tracking: MlflowParams) -> dict[str, Any]:
    """Benchmark all variants; `metrics/benchmark.json` holds one object per variant."""
    import mlflow

    from pipeline.tracking import log_parent_artifact, stage_run

    result = run_benchmark(finetuned, variant_dirs, tokenized, params, read_json(accuracy_file))
    variants = result["variants"]
    write_json(metrics_path, variants)
    write_json(metrics_path.with_name("benchmark_machine.json"), {**result["machine"], **result["settings"]})
    plot_rows(variants, plot_data)
    chart = report.with_name("variants_latency.png")
    latency_chart(variants, chart)
    write_report(result, chart, report)
    for line in target_lines(variants):
        log.info(line.replace("**", ""))
    for name, entry in variants.items():
        with stage_run(tracking, "benchmark", run_name=f"bench-{name}", tags={"variant": name}):
            mlflow.log_params({"variant": name, **to_dict(params), "cpu": result["machine"]["cpu"]})
            mlflow.set_tags({"status": entry["status"], "reason": entry["reason"][:5000]})
            mlflow.log_metrics({k: float(entry[k]) for k in METRIC_KEYS if entry.get(k) is not None})
    for f in (report, chart, metrics_path):
        log_parent_artifact(tracking, f, "comparison")
    return result
