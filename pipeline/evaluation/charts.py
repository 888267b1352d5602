"""The benchmark's charts and plot data: batch-1 latency per variant, the accuracy-latency Pareto chart with its
front, and the CSV DVC plots from."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.io import replaced_on_success, save_figure
from pipeline.core.params import TargetsParams
from pipeline.evaluation.report import pareto_front, scored_rows
from pipeline.runtimes.catalog import REFERENCE, VariantSpec, spec


def speedup_interval_text(entry: dict[str, Any]) -> str:
    """The speed-up interval as the latency chart prints it after the ratio; empty for rows without one."""
    if "speedup_p50_low" not in entry:
        return ""
    return f" ({entry['speedup_p50_low']:.2f}-{entry['speedup_p50_high']:.2f})"


def latency_chart(variants: dict[str, dict[str, Any]], path: Path, batch_size: int) -> None:
    """p50/p95 batch-1 latency and throughput at `batch_size` (`benchmark.batch_size`) per variant, FP32 eager
    first."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to touch

    names = [n for n, e in variants.items() if e["status"] == "ok"]
    p50 = np.array([variants[n]["p50_ms_b1"] for n in names])
    p95 = np.array([variants[n]["p95_ms_b1"] for n in names])
    tput = np.array([variants[n]["throughput_b32"] for n in names])
    fig = Figure(figsize=(11, 0.5 * len(names) + 1.8), dpi=110)
    axes = fig.subplots(1, 2)
    y = np.arange(len(names))
    axes[0].barh(y - 0.2, p50, height=0.4, label="p50", color="#4c72b0")
    axes[0].barh(y + 0.2, p95, height=0.4, label="p95", color="#a1c4e8")
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("latency, batch 1 (ms, lower is better)")
    axes[0].legend(loc="lower right")
    for i, n in enumerate(names):
        e = variants[n]
        axes[0].text(p50[i], i - 0.2, f" {e['speedup_p50_vs_fp32_eager']:.2f}x{speedup_interval_text(e)}",
                     va="center", fontsize=8)
    axes[1].barh(y, tput, color="#55a868")
    axes[1].set_yticks(y, [])
    axes[1].invert_yaxis()
    axes[1].set_xlabel(f"throughput, batch {batch_size} (reviews/s, higher is better)")
    fig.tight_layout()
    save_figure(fig, path)


def pareto_chart(variants: dict[str, dict[str, Any]], targets: TargetsParams, path: Path) -> None:
    """Accuracy against batch-1 p50 of every variant with both, the Pareto front joined, and the targets drawn:
    the accuracy window under FP32 and the latency `targets.min_speedup` asks for."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to touch
    from matplotlib.ticker import FuncFormatter, LogLocator

    rows = scored_rows(variants)
    front = pareto_front(variants)
    fig = Figure(figsize=(8, 5), dpi=110)
    ax = fig.subplots()
    for name, e in rows.items():
        family = _family(name)
        ax.scatter(e["p50_ms_b1"], 100 * e["accuracy"], s=50, zorder=3, color=FAMILY_COLOURS.get(family, "#777777"),
                   edgecolor="black" if name in front else "none", label=family)
    for (name, e), dy in zip(rows.items(), _label_offsets(rows), strict=True):
        ax.annotate(name, (e["p50_ms_b1"], 100 * e["accuracy"]), textcoords="offset points", xytext=(5, dy),
                    fontsize=8)
    ax.plot([rows[n]["p50_ms_b1"] for n in front], [100 * rows[n]["accuracy"] for n in front], color="black",
            linewidth=0.8, linestyle="--", zorder=2, label="Pareto front")
    if REFERENCE in rows:
        ref = rows[REFERENCE]
        ax.axhline(100 * ref["accuracy"] - targets.max_accuracy_loss_pt, color="#c44e52", linewidth=0.8,
                   label=f"FP32 - {targets.max_accuracy_loss_pt} pt")
        ax.axvline(ref["p50_ms_b1"] / targets.min_speedup, color="#8172b2", linewidth=0.8,
                   label=f"{targets.min_speedup}x FP32 eager")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="lower right")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("p50 latency, batch 1 (ms, log scale; left is faster)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs latency (outlined: the Pareto front)")
    fig.tight_layout()
    save_figure(fig, path)


def _label_offsets(rows: dict[str, dict[str, Any]]) -> list[int]:
    """Vertical label offsets (points) that keep the names of points at nearly the same place apart: labels are
    stacked upwards within a group of points less than 0.05 pt and 25 % latency from each other."""
    offsets: list[int] = []
    placed: list[tuple[float, float]] = []
    for e in rows.values():
        x, y = e["p50_ms_b1"], 100 * e["accuracy"]
        near = sum(1 for px, py in placed if abs(py - y) < 0.05 and max(px, x) / min(px, x) < 1.25)
        offsets.append(4 + 10 * near)
        placed.append((x, y))
    return offsets


FAMILY_COLOURS = {"fp32": "#4c72b0", "int8": "#55a868", "pruned": "#dd8452", "distilled": "#c44e52",
                  "tensorrt": "#8172b2"}


def catalog_row(name: str) -> VariantSpec | None:
    """The registry row of a chart's point; rows that are no registered variant have none."""
    from pipeline.runtimes.catalog import UnknownVariant

    try:
        return spec(name)
    except UnknownVariant:
        return None


def _family(name: str) -> str:
    row = catalog_row(name)
    return row.family if row is not None else "other"


def plot_rows(variants: dict[str, dict[str, Any]], path: Path) -> None:
    """One CSV row per measured variant, for `dvc plots` bar charts."""
    with replaced_on_success(path) as tmp, tmp.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["variant", "p50_ms_b1", "p95_ms_b1", "throughput_b32"])
        for name, e in variants.items():
            if e["status"] == "ok":
                w.writerow([name, round(e["p50_ms_b1"], 3), round(e["p95_ms_b1"], 3), round(e["throughput_b32"], 2)])
