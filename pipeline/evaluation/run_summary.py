"""The table `make run` prints when `dvc repro` ends: each stage's time, the headline numbers and where to look next.

Stage times are the wall times each stage process logged for this pipeline run (`pipeline.run_id`,
`logs/stages.jsonl`); a stage `dvc repro` did not re-run (its outputs were up to date or restored from the run
cache) logged none for this run and is shown as `up to date`. The numbers come from the metrics files the stages
wrote, so the table never shows a figure the pipeline did not measure.

`python -m pipeline.evaluation.run_summary [--metrics metrics] [--started EPOCH_S]`
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.runtimes.catalog import REFERENCE, TIMING_ROWS, VARIANTS

#: dvc.yaml's stages in pipeline order (tests/unit/evaluation/test_run_summary.py checks it against dvc.yaml).
STAGES = ("prepare", "finetune", "export", "quantize", "prune", "distill", "tensorrt", "evaluate", "benchmark",
          "package")


@dataclass(frozen=True)
class StageTime:
    """One stage in this run: seconds it ran (None when `dvc repro` did not run it) and what became of it: "ran",
    the outcome its log line recorded otherwise, or "up to date" when `dvc repro` skipped it."""

    stage: str
    seconds: float | None
    status: str


def stage_times(stage_log: Path, run_id: str) -> list[StageTime]:
    """Each stage's wall time in this pipeline run, from the lines stage processes append to `stage_log`
    (`pipeline.core.stage.record_stage_time`; the newest line per stage)."""
    found: dict[str, tuple[float, str]] = {}
    if stage_log.is_file():
        for line in stage_log.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a killed process
            if entry.get("run_id") == run_id:
                found[entry["stage"]] = (float(entry["seconds"]), str(entry["outcome"]))
    out = []
    for stage in STAGES:
        if stage not in found:
            out.append(StageTime(stage, None, "up to date"))
            continue
        seconds, outcome = found[stage]
        out.append(StageTime(stage, seconds, "ran" if outcome == "done" else outcome))
    return out


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def headline(metrics: Path) -> dict[str, Any]:
    """The run's headline figures from the metrics files (keys absent where a stage wrote none)."""
    finetune, package = _read(metrics / "finetune.json"), _read(metrics / "package.json")
    bench, machine = _read(metrics / "benchmark.json"), _read(metrics / "benchmark_machine.json")
    out: dict[str, Any] = {}
    if "test_accuracy" in finetune:
        out["fp32_test_accuracy"] = finetune["test_accuracy"]
    served = package.get("variant")
    if served:
        out["served"] = served
        row, ref = bench.get(served, {}), bench.get(REFERENCE, {})
        if row.get("status") == "ok":
            out["served_accuracy"] = row.get("accuracy")
            out["speedup"] = row.get("speedup_p50_vs_fp32_eager")
            out["speedup_interval"] = (row.get("speedup_p50_low"), row.get("speedup_p50_high"))
            out["p50_ms_b1"] = row.get("p50_ms_b1")
            out["fp32_p50_ms_b1"] = ref.get("p50_ms_b1")
        out["model_uri"] = package.get("registered_model", {}).get("uri")
    if machine.get("cpu"):
        isa = [flag for flag, present in machine.get("isa", {}).items() if present]
        out["cpu"] = (f"{machine['cpu']} ({', '.join(isa) or 'no listed ISA extensions'}; "
                      f"{machine.get('threads_used', '?')} threads)")
    return out


@dataclass(frozen=True)
class VariantRow:
    """One variant (or timing row) as this run's metrics record it: test accuracy and its difference to FP32 from
    the evaluate stage (`variants.json`), batch-1 latency and speed-up from the benchmark stage (`benchmark.json`),
    or why it was not built or timed."""

    name: str
    status: str  # "ok", or what became of it instead ("skipped", "failed")
    accuracy: float | None = None
    delta_pt: float | None = None
    p50_ms: float | None = None
    speedup: float | None = None
    rounds: int | None = None
    reason: str = ""


def variant_rows(metrics: Path) -> list[VariantRow]:
    """Every variant and timing row either metrics file names, in the catalog's order."""
    scored, timed = _read(metrics / "variants.json"), _read(metrics / "benchmark.json")
    rows = []
    for name in (v.name for v in VARIANTS):
        acc, bench = scored.get(name, {}), timed.get(name, {})
        if not acc and not bench:
            continue
        # the first stage's record that says it was not built, scored or timed, if any
        failed = next((r for r in (acc, bench) if r and r.get("status") != "ok"), None)
        rows.append(VariantRow(
            name, failed.get("status", "?") if failed else "ok", acc.get("accuracy"), acc.get("accuracy_delta_pt"),
            bench.get("p50_ms_b1"), bench.get("speedup_p50_vs_fp32_eager"), bench.get("rounds"),
            str(failed.get("reason", "")) if failed else ""))
    return rows


def _clause(reason: str) -> str:
    """A reason's first clause (the metrics and the report keep it whole): `prune.enabled is false`."""
    for stop in (" (", ";"):
        reason = reason.split(stop, 1)[0]
    return reason.strip() or "no reason recorded"


def render_variants(rows: list[VariantRow], served: str | None) -> list[str]:
    """The variants table: the built ones with their figures (the served one, the timing rows and rows timed in
    fewer rounds than the others marked), then the rest grouped by why they were not built."""
    if not rows:
        return []
    built = [r for r in rows if r.status == "ok"]
    full = max((r.rounds or 0 for r in built), default=0)
    lines = [f"{'variant':<24}{'test':>8}{'vs FP32':>9}{'p50 b1':>10}{'speed-up':>10}"]
    for r in built:
        short = r.rounds is not None and r.rounds < full
        notes = [n for n, on in (("served", r.name == served), ("timing only", r.name in TIMING_ROWS),
                                 (f"timed in {r.rounds} of {full} rounds", short)) if on]
        lines.append(f"{r.name:<24}"
                     f"{f'{100 * r.accuracy:.2f} %' if r.accuracy is not None else '-':>8}"
                     f"{f'{r.delta_pt:+.2f} pt' if r.delta_pt is not None and r.name != REFERENCE else '-':>9}"
                     f"{f'{r.p50_ms:.1f} ms' if r.p50_ms is not None else '-':>10}"
                     f"{f'{r.speedup:.2f}x' if r.speedup is not None else '-':>10}"
                     + (f"  {', '.join(notes)}" if notes else ""))
    why: dict[str, list[str]] = {}
    for r in rows:
        if r.status != "ok":
            why.setdefault(f"{r.status} ({_clause(r.reason)})", []).append(r.name)
    lines += [f"{reason}: {', '.join(names)}" for reason, names in why.items()]
    return [*lines, ""]


def _duration(seconds: float) -> str:
    """`45 s` under 90 s, else `12 min 05 s`, rounded to whole seconds before it is split (never `25 min 60 s`)."""
    whole = round(seconds)
    return f"{whole} s" if whole < 90 else f"{whole // 60} min {whole % 60:02d} s"


def render(times: list[StageTime], head: dict[str, Any], total_s: float | None,
           variants: list[VariantRow] | None = None) -> str:
    """The summary as plain text (fixed-width tables of the stages and the variants, then the headline and the
    next steps)."""
    lines = ["", "== sentiment-pipeline: run summary " + "=" * 44,
             f"{'stage':<11} {'time':>12}  status"]
    for t in times:
        lines.append(f"{t.stage:<11} {_duration(t.seconds) if t.seconds is not None else '-':>12}  {t.status}")
    if total_s is not None:
        lines.append(f"{'total':<11} {_duration(total_s):>12}  (wall time of make run, venv included)")
    lines.append("")
    lines += render_variants(variants or [], head.get("served"))
    if "fp32_test_accuracy" in head:
        lines.append(f"FP32 test accuracy   {100 * head['fp32_test_accuracy']:.2f} %")
    if "served" in head:
        acc = head.get("served_accuracy")
        lines.append(f"served variant       {head['served']}" + (f" ({100 * acc:.2f} % test)" if acc else "")
                     + (f", {head['model_uri']}" if head.get("model_uri") else ""))
    if head.get("speedup"):
        low, high = head["speedup_interval"]
        lines.append(f"speed-up vs FP32     {head['speedup']:.2f}x p50 at batch 1 ({low:.2f}-{high:.2f}, 90 %): "
                     f"{head['p50_ms_b1']:.1f} ms vs {head['fp32_p50_ms_b1']:.1f} ms"
                     + (f" on {head['cpu']}" if head.get("cpu") else ""))
    lines += ["", "next:  make serve   then   .venv/bin/python -m serving.client \"a wonderful film\"",
              "       make mlflow-ui (runs, models, @champion)   reports/benchmark/   .venv/bin/dvc metrics show",
              "=" * 79]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", type=Path, default=Path("metrics"))
    parser.add_argument("--started", type=float, default=None, help="epoch seconds make run started at")
    args = parser.parse_args(argv)

    from pipeline.core.run_id import pipeline_run_id
    from pipeline.core.stage import STAGE_LOG, STAGE_LOG_ENV

    times = stage_times(Path(os.environ.get(STAGE_LOG_ENV, STAGE_LOG)), pipeline_run_id(os.environ))
    total = time.time() - args.started if args.started else None
    print(render(times, headline(args.metrics), total, variant_rows(args.metrics)))


if __name__ == "__main__":
    main()
