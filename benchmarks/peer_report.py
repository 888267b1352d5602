"""What `benchmarks.peers` concludes from its rows: which of the pipeline's variants and which peer runtime is fastest
within the accuracy budget (`verdicts`), the share of the CPU's measured INT8 GEMM peak the fastest one reaches
(`ceiling_fraction`), the printed table and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.io import read_json
from pipeline.core.machine import isa_record
from pipeline.core.params import TargetsParams
from pipeline.evaluation.latency import speedup
from pipeline.selection import within_budget

ROOT = Path(__file__).resolve().parents[1]
#: The row every speed-up is measured against: the finetuned teacher in PyTorch eager FP32.
REFERENCE_ROW = "teacher/pytorch-eager/fp32"


def weight_gemm_flops(config: dict[str, Any], tokens: int, cls_readout: bool) -> float:
    """Multiply-add FLOPs (2 per MAC) of one review's weight products (Q, K, V, output, FFN up and down in every
    layer) over `tokens` real tokens; with the [CLS] readout the last layer computes K and V for every token and
    the rest for [CLS] alone. Attention's score products and the classifier head are left out, as in the
    ceiling measurement."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    per_token = 4 * h * h + 2 * h * i
    if not cls_readout:
        return 2.0 * layers * tokens * per_token
    return 2.0 * ((layers - 1) * tokens * per_token + tokens * 2 * h * h + (2 * h * h + 2 * h * i))


def ceiling_fraction(row: dict[str, Any], config: dict[str, Any], tp_batches: list[tuple[np.ndarray, ...]],
                     ceiling_file: Path) -> dict[str, Any] | None:
    """Share of the CPU's measured INT8 GEMM peak (the fastest bare `MatMulInteger` product of the ceiling
    measurement, in FLOP/s) that `row` reaches at `benchmark.batch_size`: its weight-product FLOPs per review (real
    tokens of the same batches) times its reviews/s."""
    if not ceiling_file.is_file():
        return None
    ceiling = read_json(ceiling_file)
    measured_on = ceiling.get("machine", {})
    here = isa_record()
    if measured_on.get("isa") and (measured_on.get("cpu"), measured_on["isa"]) != (here["cpu"], here["isa"]):
        # a peak is a property of one CPU: an AVX2 ceiling says nothing of what a VNNI CPU leaves on the table
        have = sorted(f for f, on in measured_on["isa"].items() if on)
        return {"row": row["name"], "skipped": (
            f"{ceiling_file.name} was measured on another CPU ({measured_on.get('cpu')}: {', '.join(have)}); run "
            f"`python -m benchmarks.int8_gemm_ceiling --out <file>` here and pass it with --ceiling")}
    tokens = ceiling["tokens"]
    rates = {p["product"]: 2.0 * tokens * p["k"] * p["n"] / (p["int8-gemm-only_p50_ms"] / 1e3)
             for p in ceiling["products"]}
    best = max(rates, key=rates.__getitem__)
    lengths = [int(m.sum()) for _, mask in tp_batches for m in mask]
    flops = float(np.mean([weight_gemm_flops(config, n, bool(row.get("cls_readout"))) for n in lengths]))
    achieved = flops * row["reviews_per_s_b32"]
    return {"row": row["name"], "gemm_flops_per_review": flops, "mean_real_tokens": float(np.mean(lengths)),
            "achieved_gflops": achieved / 1e9, "peak_int8_gflops": rates[best] / 1e9, "peak_product": best,
            "peak_measured": ceiling.get("machine", {}).get("cpu", ""), "fraction_of_peak": achieved / rates[best],
            "source": str(ceiling_file.relative_to(ROOT) if ceiling_file.is_relative_to(ROOT) else ceiling_file)}


def verdicts(rows: list[dict[str, Any]], targets: TargetsParams) -> list[dict[str, Any]]:
    """At batch 1 (p50) and `benchmark.batch_size` (reviews/s): the fastest of our rows and the fastest peer, each
    within the accuracy budget against the teacher's FP32 eager accuracy (`pipeline.selection.within_budget`), and
    which wins by how much. Batch 1 carries the paired bootstrap interval of p50(ours) / p50(peer) by rounds."""
    ref = next(r for r in rows if r["name"] == REFERENCE_ROW)
    ok = [r for r in rows if r["status"] == "ok" and r.get("accuracy") is not None
          and within_budget(ref["accuracy"], r["accuracy"], targets)]
    out = []
    for metric, better in (("p50_ms_b1", min), ("reviews_per_s_b32", max)):
        ours = [r for r in ok if r["ours"]]
        peers = [r for r in ok if not r["ours"]]
        if not ours or not peers:
            continue
        a, b = better(ours, key=lambda r: r[metric]), better(peers, key=lambda r: r[metric])
        ratio = (b[metric] / a[metric]) if metric == "p50_ms_b1" else (a[metric] / b[metric])
        entry = {"metric": metric, "best_ours": a["name"], "best_ours_value": a[metric],
                 "best_peer": b["name"], "best_peer_value": b[metric], "ours_speed_vs_peer": ratio,
                 "winner": "ours" if ratio >= 1 else "peer"}
        if metric == "p50_ms_b1":
            gain = speedup({"p50_ms_b1": b[metric], "latency_rounds_ms": b["_rounds"]},
                           {"p50_ms_b1": a[metric], "latency_rounds_ms": a["_rounds"]})
            entry["interval"] = [gain.low, gain.high]
        out.append(entry)
    return out


def chart(rows: list[dict[str, Any]], path: Path, title: str, batch_size: int) -> None:
    """p50 at batch 1 and reviews/s at `batch_size` (`benchmark.batch_size`) per row, the pipeline's rows in green,
    accuracy in the labels."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to touch

    from pipeline.core.io import save_figure

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['name']}  ({100 * r['accuracy']:.2f} %)" if r.get("accuracy") is not None else r["name"]
              for r in ok]
    colors = ["#55a868" if r["ours"] else "#4c72b0" for r in ok]
    y = np.arange(len(ok))
    fig = Figure(figsize=(13, 0.42 * len(ok) + 1.9), dpi=110)
    axes = fig.subplots(1, 2)
    axes[0].barh(y, [r["p50_ms_b1"] for r in ok], color=colors)
    axes[0].errorbar([r["p95_ms_b1"] for r in ok], y, fmt="|", color="black", label="p95")
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("p50 latency, batch 1 (ms, lower is better); | = p95")
    axes[1].barh(y, [r["reviews_per_s_b32"] for r in ok], color=colors)
    axes[1].set_yticks(y, [])
    axes[1].invert_yaxis()
    axes[1].set_xlabel(f"reviews/s at batch {batch_size} (higher is better)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)  # written whole or not at all


def table(rows: list[dict[str, Any]], batch_size: int) -> str:
    """The printed table: one line per row, skipped rows with their reason; reviews/s at `batch_size`."""
    head = (f"{'row':<46}{'acc %':>7}{'agree':>7}{'p50 ms':>8}{'p95 ms':>8}{'x eager (90 %)':>19}"
            f"{f'rev/s@{batch_size}':>9}{'RSS MB':>8}{'build s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r["name"] + (" *" if r["ours"] else "")
        if r["status"] != "ok":
            lines.append(f"{name:<46}{r['status']}: {r['reason'][:110]}")
            continue
        interval = (f"{r['speedup_p50']:.2f} [{r['speedup_p50_low']:.2f},{r['speedup_p50_high']:.2f}]"
                    if "speedup_p50_low" in r else f"{r['speedup_p50']:.2f}")
        rss = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") is not None else "-"
        lines.append(f"{name:<46}{100 * r['accuracy']:>7.2f}{100 * r['agreement_with_fp32']:>7.1f}"
                     f"{r['p50_ms_b1']:>8.2f}{r['p95_ms_b1']:>8.2f}{interval:>19}{r['reviews_per_s_b32']:>9.1f}"
                     f"{rss:>8}{r['build_s']:>8.1f}")
    return "\n".join(lines)
