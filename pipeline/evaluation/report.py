"""The benchmark report a user reads: `report_data` gathers everything `reports/variants.md` says as values (the
rows, the target verdicts `pipeline.selection` decides, the speed-up's sources, the Pareto front, the machine and
its notes) and `templates/variants.md.j2` renders them as markdown; the charts are `pipeline.evaluation.charts`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from pipeline.core.io import replaced_on_success
from pipeline.core.params import TargetsParams
from pipeline.evaluation.latency import SPEEDUP_LEVEL, percentiles
from pipeline.runtimes.catalog import READOUT_ROW, REFERENCE
from pipeline.selection import (
    PairVerdict,
    SpeedVerdict,
    qat_verdicts,
    smaller_model_family,
    speed_verdicts,
    static_verdicts,
)

#: The chain of rows that splits the best INT8 student's speed-up into its causes: each step changes one thing.
SPEEDUP_STEPS = (
    ("[CLS] readout (last layer computes one position)", REFERENCE, READOUT_ROW),
    ("runtime (ONNX Runtime graph vs PyTorch eager, both with the readout)", READOUT_ROW, "fp32-onnx"),
    ("quantization (dynamic INT8 of the same model)", "fp32-onnx", "int8-dynamic"),
    ("smaller model (the distilled student, both INT8)", "int8-dynamic", "int8-distilled"),
)
#: The chain's first step where no variant has the readout (`export.cls_readout: false`): its graph alone.
NO_READOUT_STEP = ("runtime (ONNX Runtime graph vs PyTorch eager)", REFERENCE, "fp32-onnx")
#: The templates: `variants.md.j2` is the page, `parts.md.j2` the table and target lines it shares with the terminal.
TEMPLATES = Path(__file__).with_name("templates")


@dataclass(frozen=True)
class Interval:
    """A speed-up's interval over the alternating rounds (`pipeline.evaluation.latency.speedup_interval`)."""

    low: float
    high: float
    level: float = SPEEDUP_LEVEL


@dataclass(frozen=True)
class Row:
    """One table row: a measured variant's numbers (None where unknown), or a skipped one's reason."""

    name: str
    status: str  # "ok" | "skipped"
    reason: str = ""
    readout: bool = False  # † : the graph's last layer computes only the [CLS] position
    accuracy_pct: float | None = None
    size_mb: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    throughput: float | None = None  # reviews/s at the benchmark's batch size
    peak_rss_mb: float | None = None
    speedup: float | None = None  # batch-1 p50 over FP32 eager's
    interval: Interval | None = None


@dataclass(frozen=True)
class TargetLine:
    """One latency verdict of `pipeline.selection.speed_verdicts`, with the numbers the report states beside it."""

    scope: str  # "all" INT8 variants, or "quantization" alone (no pruning or distillation)
    verdict: SpeedVerdict
    max_loss_pt: float
    p50_ms: float
    smaller_model: str | None  # "pruned" | "distilled": the best variant's speed also comes from a smaller model
    interval: Interval | None
    accuracy_delta_pt: float | None  # against FP32 eager; None where either accuracy is unknown


@dataclass(frozen=True)
class SpeedupChain:
    """`speedup_sources`' steps (two or more) and the speed-up they multiply to."""

    steps: list[dict[str, Any]]
    product: float


@dataclass(frozen=True)
class Machine:
    """The CPU the rows ran on; `decided_with_*` where `PIPELINE_CPU_FLAGS` made the `auto` decisions instead."""

    cpu: str
    logical_cpus: int
    threads_used: int
    isa: dict[str, bool]
    versions: dict[str, str]
    decided_with_source: str | None = None
    decided_with_isa: dict[str, bool] | None = None


@dataclass(frozen=True)
class Notes:
    """Which explanatory paragraphs the report carries."""

    readout: bool  # some row has † (its speed-up is partly the graph's, not the number format's)
    no_int8_dot: bool  # this CPU has neither VNNI nor AMX: INT8 ran on AVX2 kernels
    s8_saturates: bool  # signed 8-bit weights ran on those kernels, whose pair sums saturate


@dataclass(frozen=True)
class Report:
    """Everything `reports/variants.md` says."""

    settings: dict[str, Any]  # seq_len, batch_size, rounds, iterations, warmup
    rows: list[Row]
    chart: str
    pareto_chart: str | None
    pareto_front: list[str]  # stated with the Pareto chart
    speedup: SpeedupChain | None  # None when fewer than two steps were measured
    targets: list[TargetLine]  # empty when no INT8 variant was measured
    qat: list[PairVerdict]  # one per QAT variant measured beside its runtime's post-training variant
    static: list[PairVerdict]  # one per static-scale onnxruntime recipe measured beside int8-dynamic
    machine: Machine
    bf16_row: str | None
    weight_formats: list[str]
    notes: Notes
    fewer_rounds: list[str]  # "name (rounds, samples)" of each row left out early (`latency.Apart`)


def speedup_sources(variants: dict[str, dict[str, Any]],
                    rounds: dict[str, list[list[float]]] | None = None) -> list[dict[str, Any]]:
    """Each step of `SPEEDUP_STEPS` whose two rows were measured: the batch-1 p50 ratio it contributes. Along
    the chain the factors multiply to the last row's p50 speed-up over FP32 eager.

    With `rounds` (the benchmark's samples by round, `latency_rounds_ms`) every row of the chain is taken over the
    rounds all of them were timed in (the first ones: `latency.Apart` stops a row early, never late), so each
    factor is a ratio of p50s over the same rounds and each step's `rounds` says how many. Without it each row's
    own p50 is used, which is only paired where every row ran every round."""
    steps = SPEEDUP_STEPS
    if variants.get(READOUT_ROW, {}).get("status") != "ok":  # no readout to split off: eager to the graph in one step
        steps = (NO_READOUT_STEP, *SPEEDUP_STEPS[2:])
    measured = [(what, before, after) for what, before, after in steps
                if variants.get(before, {}).get("status") == "ok" and variants.get(after, {}).get("status") == "ok"]
    names = {n for _, before, after in measured for n in (before, after)}
    if rounds is not None and names <= rounds.keys():
        common = min(len(rounds[n]) for n in names)
        p50 = {n: percentiles([x for samples in rounds[n][:common] for x in samples])["p50"] for n in names}
    else:
        common, p50 = None, {n: variants[n]["p50_ms_b1"] for n in names}
    return [{"step": what, "from": before, "to": after, "factor": p50[before] / p50[after], "rounds": common}
            for what, before, after in measured]


def speedup_chain(variants: dict[str, dict[str, Any]],
                  rounds: dict[str, list[list[float]]] | None = None) -> SpeedupChain | None:
    """The speed-up decomposition the report shows (`speedup_sources`), or None when fewer than two steps were
    measured."""
    steps = speedup_sources(variants, rounds)
    if len(steps) < 2:
        return None
    return SpeedupChain(steps, float(np.prod([s["factor"] for s in steps])))


def interval_of(entry: dict[str, Any]) -> Interval | None:
    """A row's speed-up interval, where it has one (FP32 eager, the reference, has none)."""
    return Interval(entry["speedup_p50_low"], entry["speedup_p50_high"]) if "speedup_p50_low" in entry else None


def report_rows(variants: dict[str, dict[str, Any]]) -> list[Row]:
    """The table's rows, in the benchmark's order."""
    rows = []
    for name, e in variants.items():
        if e["status"] != "ok":
            rows.append(Row(name, e["status"], e["reason"]))
            continue
        acc = e.get("accuracy")
        rows.append(Row(name, "ok", readout=bool(e.get("cls_readout")),
                        accuracy_pct=None if acc is None else 100 * acc, size_mb=e.get("size_mb"),
                        p50_ms=e["p50_ms_b1"], p95_ms=e["p95_ms_b1"], p99_ms=e["p99_ms_b1"],
                        throughput=e["throughput_b32"], peak_rss_mb=e.get("peak_rss_mb"),
                        speedup=e["speedup_p50_vs_fp32_eager"], interval=interval_of(e)))
    return rows


def target_verdicts(variants: dict[str, dict[str, Any]], targets: TargetsParams) -> list[TargetLine]:
    """The latency verdicts (`pipeline.selection.speed_verdicts`) with their numbers.

    Pruned and distilled variants (`int8-pruned`, `int8-distilled`) compute fewer FLOPs, so the target is stated
    twice when one is present: over every INT8 variant, and over quantization alone, so nobody reads a smaller
    model's gain as an INT8 one.
    """
    out = []
    for scope, v in speed_verdicts(variants, targets):
        row, ref_acc = variants[v.best], variants[REFERENCE].get("accuracy")
        delta = None if ref_acc is None or row.get("accuracy") is None else 100 * (row["accuracy"] - ref_acc)
        out.append(TargetLine(scope, v, targets.max_accuracy_loss_pt, row["p50_ms_b1"],
                              smaller_model_family(v.best), interval_of(row), delta))
    return out


def scored_rows(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rows with both a measured latency and an accuracy."""
    return {n: e for n, e in variants.items() if e["status"] == "ok" and e.get("accuracy") is not None}


def pareto_front(variants: dict[str, dict[str, Any]]) -> list[str]:
    """The measured variants no other beats on both batch-1 p50 and accuracy, fastest first."""
    rows = scored_rows(variants)
    front = [n for n, e in rows.items()
             if not any(o["p50_ms_b1"] <= e["p50_ms_b1"] and o["accuracy"] >= e["accuracy"]
                        and (o["p50_ms_b1"], o["accuracy"]) != (e["p50_ms_b1"], e["accuracy"])
                        for o in rows.values())]
    return sorted(front, key=lambda n: rows[n]["p50_ms_b1"])


def machine_of(record: dict[str, Any]) -> Machine:
    """The machine section's values from the benchmark's machine record (`pipeline.core.machine.machine_info`)."""
    decided = record.get("decided_with")
    return Machine(record["cpu"], record["logical_cpus"], record["threads_used"], record["isa"], record["versions"],
                   decided["source"] if decided else None, decided["isa"] if decided else None)


def report_data(result: dict[str, Any], chart: Path, targets: TargetsParams, pareto: Path | None = None) -> Report:
    """What the report says about a benchmark `result` (`run_benchmark`'s), its charts named by file."""
    from pipeline.core.machine import INT8_DOT_FLAGS

    variants, machine, settings = result["variants"], result["machine"], result["settings"]
    formats = sorted({str(v["weight_format"]) for v in variants.values() if v.get("weight_format")})
    no_int8_dot = not any(machine["isa"].get(f) for f in INT8_DOT_FLAGS)
    notes = Notes(readout=any(e.get("cls_readout") for e in variants.values()), no_int8_dot=no_int8_dot,
                  s8_saturates=no_int8_dot and "s8" in formats)
    return Report(settings=settings, rows=report_rows(variants), chart=chart.name,
                  pareto_chart=pareto.name if pareto else None, pareto_front=pareto_front(variants),
                  speedup=speedup_chain(variants, result.get("latency_rounds_ms")),
                  targets=target_verdicts(variants, targets),
                  qat=qat_verdicts(variants, targets), static=static_verdicts(variants, targets),
                  machine=machine_of(machine), bf16_row=settings.get("bf16_row_choice"), weight_formats=formats,
                  notes=notes, fewer_rounds=[f"{n} ({e['rounds']} rounds, {e['latency_samples']} samples)"
                                             for n, e in variants.items()
                                             if e.get("status") == "ok" and e.get("rounds", settings["rounds"])
                                             < settings["rounds"]])


def number(value: float | None, spec: str) -> str:
    """A table cell's number in `spec`, or – where it is unknown; a value that rounds to zero is never signed
    negative (-0.004 at `+.2f` is +0.00, not -0.00)."""
    if value is None:
        return "–"
    text = format(value, spec)
    if text.startswith("-") and math.isfinite(value) and not any(ch in "123456789" for ch in text):
        text = format(0.0, spec)
    return text


def environment() -> jinja2.Environment:
    """The markdown templates next to this module: no HTML escaping, an unknown name is an error."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["num"] = number
    return env


def render(report: Report) -> str:
    """The report as markdown."""
    return environment().get_template("variants.md.j2").render(report=report)


def part(macro: str, *args: Any) -> str:
    """One macro of `parts.md.j2` (the table, the target lines) rendered on its own, for the terminal."""
    return str(getattr(environment().get_template("parts.md.j2").module, macro)(*args))


def markdown_table(variants: dict[str, dict[str, Any]], batch_size: int) -> str:
    """The comparison as a Markdown table (skipped rows say why), as the report prints it; `batch_size`: the
    throughput's batch (`benchmark.batch_size`), named in its column."""
    return part("table", report_rows(variants), batch_size)


def target_lines(variants: dict[str, dict[str, Any]], targets: TargetsParams) -> list[str]:
    """The latency verdicts as the report's plain statements with the numbers, one per line."""
    return part("target_lines", target_verdicts(variants, targets)).splitlines()


def pair_lines(variants: dict[str, dict[str, Any]], targets: TargetsParams, batch_size: int) -> list[str]:
    """The QAT and static-scale verdicts (`pipeline.selection.qat_verdicts`, `static_verdicts`) as the report states
    them, one per line; `batch_size`: the throughput's batch (`benchmark.batch_size`)."""
    return [*(part("qat_line", q, batch_size) for q in qat_verdicts(variants, targets)),
            *(part("static_line", v) for v in static_verdicts(variants, targets))]


def write_report(result: dict[str, Any], chart: Path, path: Path, targets: TargetsParams,
                 pareto: Path | None = None) -> None:
    """`reports/variants.md`: the table, the charts, where the speed-up comes from, the machine and the targets,
    readable on its own."""
    with replaced_on_success(path) as tmp:
        tmp.write_text(render(report_data(result, chart, targets, pareto)))
