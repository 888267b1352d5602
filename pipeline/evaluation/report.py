"""The benchmark report a user reads, in markdown: the table, the target lines (rendered from
`pipeline.selection`'s verdicts), the speed-up's sources and notes on the machine; the charts are
`pipeline.evaluation.charts`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.params import TargetsParams
from pipeline.evaluation.latency import SPEEDUP_LEVEL
from pipeline.runtimes.catalog import READOUT_ROW, REFERENCE, VariantSpec, spec
from pipeline.selection import SpeedVerdict, smaller_model_family, speed_verdicts

#: The chain of rows that splits the best INT8 student's speed-up into its causes: each step changes one thing.
SPEEDUP_STEPS = (
    ("[CLS] readout (last layer computes one position)", REFERENCE, READOUT_ROW),
    ("runtime (ONNX Runtime graph vs PyTorch eager, both with the readout)", READOUT_ROW, "fp32-onnx"),
    ("quantization (dynamic INT8 of the same model)", "fp32-onnx", "int8-dynamic"),
    ("smaller model (the distilled student, both INT8)", "int8-dynamic", "int8-distilled"),
)


def speedup_sources(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step of `SPEEDUP_STEPS` whose two rows were measured: the batch-1 p50 ratio it contributes. Along
    the chain the factors multiply to the last row's speed-up over FP32 eager."""
    out = []
    for what, before, after in SPEEDUP_STEPS:
        a, b = variants.get(before, {}), variants.get(after, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            out.append({"step": what, "from": before, "to": after, "factor": a["p50_ms_b1"] / b["p50_ms_b1"]})
    return out


def speedup_sources_lines(variants: dict[str, dict[str, Any]]) -> list[str]:
    """The speed-up decomposition as a Markdown table (empty when fewer than two steps were measured)."""
    steps = speedup_sources(variants)
    if len(steps) < 2:
        return []
    lines = ["## Where the speed-up comes from", "",
             "Batch-1 p50 ratios between rows that differ in one thing; along the chain they multiply.", "",
             "| step | from | to | factor |", "|---|---|---|---:|"]
    lines += [f"| {s['step']} | {s['from']} | {s['to']} | {s['factor']:.2f}x |" for s in steps]
    total = float(np.prod([s["factor"] for s in steps]))
    lines += ["", f"Product: {total:.2f}x ({steps[0]['from']} -> {steps[-1]['to']}).", ""]
    return lines


def target_lines(variants: dict[str, dict[str, Any]], targets: TargetsParams) -> list[str]:
    """The latency verdicts (`pipeline.selection.speed_verdicts`) as plain statements with the numbers.

    Pruned and distilled variants (`int8-pruned`, `int8-distilled`) compute fewer FLOPs, so the target is stated
    twice when one is present: over every INT8 variant, and over quantization alone, so nobody reads a smaller
    model's gain as an INT8 one.
    """
    verdicts = speed_verdicts(variants, targets)
    if not verdicts:
        return ["No INT8 variant was measured."]
    scopes = {"all": "", "quantization": "quantization alone (no pruning or distillation): "}
    return [_target_line(variants, v, targets.max_accuracy_loss_pt, scopes[scope]) for scope, v in verdicts]


#: What makes a smaller-model family's variants fast besides INT8, as the target line says it.
SMALLER_MODEL = {"pruned": "structured pruning + INT8: fewer FLOPs, not faster INT8 kernels alone",
                 "distilled": "distilled student + INT8: a smaller model, not faster INT8 kernels alone"}


def smaller_model(name: str) -> str | None:
    """Why a variant's speed also comes from a smaller model (pruned or distilled), or None when it does not."""
    family = smaller_model_family(name)
    return SMALLER_MODEL[family] if family else None


def catalog_row(name: str) -> VariantSpec | None:
    """The registry row of a table row; rows that are no registered variant have none."""
    from pipeline.runtimes.catalog import UnknownVariant

    try:
        return spec(name)
    except UnknownVariant:
        return None


def _target_line(variants: dict[str, dict[str, Any]], v: SpeedVerdict, max_loss_pt: float, scope: str) -> str:
    row, ref_acc = variants[v.best], variants[REFERENCE].get("accuracy")
    loss = ""
    if ref_acc is not None and row.get("accuracy") is not None:
        loss = f", {100 * (row['accuracy'] - ref_acc):+.2f} pt accuracy"
    why = smaller_model(v.best)
    kind = f" ({why})" if why else ""
    spread = ""
    if "speedup_p50_low" in row:
        spread = (f" ({100 * SPEEDUP_LEVEL:.0f} % interval over the rounds {row['speedup_p50_low']:.2f}-"
                  f"{row['speedup_p50_high']:.2f}x")
        if v.straddles:
            spread += f": it straddles {v.min_speedup}x, so this verdict could go the other way in another run"
        spread += ")"
    who = (f"Best INT8 variant within {max_loss_pt} pt of FP32 accuracy: **{v.best}**{kind}" if v.within_budget
           else f"No INT8 variant is within {max_loss_pt} pt of FP32 accuracy; the fastest INT8 variant is "
                f"**{v.best}**{kind}")
    return (f"{scope}{who}, p50 {row['p50_ms_b1']:.2f} ms at batch 1 = **{v.speedup:.2f}x** FP32 eager{spread}{loss} "
            f"({'met' if v.met else 'MISSED'}: target >= {v.min_speedup}x within {max_loss_pt} pt).")


def readout_note(variants: dict[str, dict[str, Any]]) -> list[str]:
    """What † means, when a row has it: part of those rows' speed-up is the graph, not the number format."""
    if not any(e.get("cls_readout") for e in variants.values()):
        return []
    return ["† The exported graph's last encoder layer computes only the [CLS] position the classifier reads "
            "(`export.cls_readout`; keys and values still come from every token, so the logits are the same, "
            "parity-checked at export). FP32 eager computes the whole layer: compare an INT8 † row with "
            "fp32-onnx † for the share that INT8 alone brings.", ""]


def isa_line(isa: dict[str, bool]) -> str:
    """ISA flags as `flag=yes|no`, in the record's order."""
    return ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in isa.items())


def int8_kernel_note(isa: dict[str, bool], formats: set[str]) -> list[str]:
    """A paragraph for a CPU without INT8 dot products (VNNI/AMX): slower INT8 kernels, and a warning where signed
    8-bit weights ran on them, whose products saturate there (`pipeline.core.machine.resolve_weight_format`)."""
    from pipeline.core.machine import INT8_DOT_FLAGS

    if any(isa.get(f) for f in INT8_DOT_FLAGS):
        return []
    note = ("This CPU has neither VNNI nor AMX: INT8 matrix kernels fall back to AVX2 (U8S8 `vpmaddubsw`, U8U8 "
            "16-bit multiplies), so INT8 speed-ups are smaller here than on a VNNI/AMX CPU.")
    if "s8" in formats:
        note += (" **Signed 8-bit weights (`s8`) ran on these kernels: their int16 pair sums saturate, so those "
                 "variants' products are not exact here; `quantize.weight_format: auto` picks an exact format.**")
    return [note, ""]


def write_report(result: dict[str, Any], chart: Path, path: Path, targets: TargetsParams,
                 pareto: Path | None = None) -> None:
    """`reports/variants.md`: the table, the charts, where the speed-up comes from, the machine and the targets,
    readable on its own."""
    variants, machine, settings = result["variants"], result["machine"], result["settings"]
    isa = isa_line(machine["isa"])
    formats = {str(v["weight_format"]) for v in variants.values() if v.get("weight_format")}
    lines = [
        "# Variant comparison: quantized and exported vs FP32",
        "",
        f"Batch-1 latency at sequence length {settings['seq_len']} (real test reviews truncated/padded), "
        f"throughput at batch {settings['batch_size']} with dynamic padding; {settings['rounds']} alternating rounds, "
        f"{settings['iterations']} latency samples per variant, each round after {settings['warmup']} untimed warm-up "
        "calls (the first calls after a switch run cold). Accuracy "
        "and size come from `metrics/variants.json` (the same test split as `finetune`).",
        "",
        markdown_table(variants),
        "",
        *readout_note(variants),
        f"![latency and throughput]({chart.name})",
        "",
        *([f"![accuracy vs latency]({pareto.name})", "",
           f"Pareto front (fastest first): {', '.join(pareto_front(variants))}.", ""] if pareto else []),
        *speedup_sources_lines(variants),
        "## Targets",
        "",
        *[f"- {t}" for t in target_lines(variants, targets)],
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu']} ({machine['logical_cpus']} logical CPUs, {machine['threads_used']} threads used)",
        f"- ISA: {isa}",
        *([f"- `auto` settings decided with {machine['decided_with']['source']}'s flags, not this CPU's: "
           f"{isa_line(machine['decided_with']['isa'])} (a rehearsal of another CPU's choices; the kernels timed "
           "above ran on this CPU's ISA)"] if "decided_with" in machine else []),
        f"- versions: {', '.join(f'{k} {v}' for k, v in machine['versions'].items())}",
        *([f"- bf16 row: {settings['bf16_row_choice']}"] if "bf16_row_choice" in settings else []),
        *([f"- INT8 weight format: {', '.join(sorted(formats))} (`quantize.weight_format`; each variant's "
           "`variant.json` says how `auto` resolved)"] if formats else []),
        "",
    ]
    lines += int8_kernel_note(machine["isa"], formats)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def markdown_table(variants: dict[str, dict[str, Any]]) -> str:
    """The comparison as a Markdown table (skipped rows say why)."""
    head = ("| variant | accuracy | size MB | p50 ms | p95 ms | p99 ms | reviews/s @32 | peak RSS MB | speedup p50 |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [head]

    def f(v: Any, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    for name, e in variants.items():
        if e["status"] != "ok":
            rows.append(f"| {name} | skipped: {e['reason']} |  |  |  |  |  |  |  |")
            continue
        acc = e.get("accuracy")
        mark = " †" if e.get("cls_readout") else ""
        rows.append(f"| {name}{mark} | {f(None if acc is None else 100 * acc, '.2f')} | {f(e.get('size_mb'), '.1f')} | "
                    f"{e['p50_ms_b1']:.2f} | {e['p95_ms_b1']:.2f} | {e['p99_ms_b1']:.2f} | "
                    f"{e['throughput_b32']:.1f} | {f(e.get('peak_rss_mb'), '.0f')} | "
                    f"{e['speedup_p50_vs_fp32_eager']:.2f}x{speedup_interval_text(e)} |")
    if any("speedup_p50_low" in e for e in variants.values()):
        rows.append(f"\nSpeed-up in brackets: {100 * SPEEDUP_LEVEL:.0f} % interval over the alternating rounds "
                    "(`pipeline.evaluation.latency.speedup_interval`).")
    return "\n".join(rows)


def speedup_interval_text(entry: dict[str, Any]) -> str:
    """The speed-up interval as the table and the chart print it after the ratio; empty for rows without one."""
    if "speedup_p50_low" not in entry:
        return ""
    return f" ({entry['speedup_p50_low']:.2f}-{entry['speedup_p50_high']:.2f})"


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
