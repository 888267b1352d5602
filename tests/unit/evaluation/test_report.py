"""Unit: the benchmark report: table rows (skipped, intervals) and the target lines."""

from __future__ import annotations

from pipeline.core.params import TargetsParams
from pipeline.evaluation.report import markdown_table, target_lines


def _row(p50: float, acc: float | None = 0.9) -> dict:
    return {"status": "ok", "reason": "", "p50_ms_b1": p50, "p95_ms_b1": p50 * 1.2, "p99_ms_b1": p50 * 1.5,
            "throughput_b32": 100 / p50, "speedup_p50_vs_fp32_eager": 10 / p50, "accuracy": acc, "size_mb": 20.0}


def test_skipped_rows_and_targets_in_report():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "tensorrt-int8": {"status": "skipped", "reason": "no CUDA device visible"}}
    table = markdown_table(variants)
    assert "| tensorrt-int8 | skipped: no CUDA device visible |" in table
    assert "2.50x" in table
    (line,) = target_lines(variants, TargetsParams())
    # int8-dynamic is faster but loses 5 pt, so the eligible best is int8-static at 2.5x: a miss
    assert "int8-static" in line and "2.50x" in line and "MISSED" in line


def test_speedup_interval_in_table_and_target_line():
    variants = {"fp32-eager": _row(10.0), "int8-dynamic": _row(3.5, 0.898)}
    variants["int8-dynamic"].update(speedup_p50_low=2.6, speedup_p50_high=3.1)
    table = markdown_table(variants)
    assert "2.86x (2.60-3.10)" in table and "90 % interval" in table
    (line,) = target_lines(variants, TargetsParams())
    assert "MISSED" in line and "2.60-3.10x" in line and "straddles 3.0x" in line
    variants["int8-dynamic"].update(speedup_p50_high=2.9)
    assert "straddles" not in target_lines(variants, TargetsParams())[0]


def test_pruned_variant_target_stated_apart_from_quantization_alone():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "int8-pruned": _row(3.0, 0.897)}
    overall, plain = target_lines(variants, TargetsParams())
    assert "**int8-pruned** (structured pruning + INT8" in overall and "3.33x" in overall and "met" in overall
    assert "-0.30 pt" in overall
    assert plain.startswith("quantization alone (no pruning): ")
    assert "int8-static" in plain and "2.50x" in plain and "MISSED" in plain
