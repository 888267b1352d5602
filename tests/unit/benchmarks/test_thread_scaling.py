"""Unit: `benchmarks.thread_scaling` on the tiny model: every unit measured at each thread count, with the speed-up
and efficiency arithmetic. Never timings."""

from __future__ import annotations

import pytest

from benchmarks.thread_scaling import main, scaling_rows, thread_counts
from pipeline.core.io import read_json


@pytest.mark.parametrize(("cpus", "expected"), [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_thread_counts_double_up_to_the_cpus(cpus, expected):
    assert thread_counts(cpus) == expected


def test_speedup_and_efficiency_for_rates_and_latencies():
    rows = {r["unit"]: r["by_threads"] for r in scaling_rows(
        {"rate": {1: 10.0, 2: 18.0}, "latency": {1: 20.0, 2: 10.0}}, {"rate": True, "latency": False})}
    assert rows["rate"]["1"] == {"value": 10.0, "speedup": 1.0, "efficiency": 1.0}
    assert rows["rate"]["2"]["speedup"] == pytest.approx(1.8) and rows["rate"]["2"]["efficiency"] == pytest.approx(0.9)
    assert rows["latency"]["2"]["speedup"] == pytest.approx(2.0) and rows["latency"]["2"]["efficiency"] == 1.0


def test_a_run_measures_training_scoring_and_latency_at_each_count(built, tiny_model_dir, tmp_path):
    out = tmp_path / "scaling.json"
    params = tmp_path / "params.yaml"
    params.write_text("benchmark:\n  seq_len: 16\n")  # the synthetic reviews are short: timed at 16 real tokens
    main(["--params", str(params), "--finetuned", str(tiny_model_dir), "--variants-root", str(built["root"]),
          "--tokenized", str(built["tokenized"]), "--threads", "1,2", "--reviews", "8", "--train-reviews", "32",
          "--latency-calls", "2", "--rounds", "1", "--out", str(out),
          "--variants", "fp32-onnx,int8-static,int8-openvino"])  # int8-static: scored by rows
    result = read_json(out)
    units = [r["unit"] for r in result["rows"]]
    # fp32-eager and the three asked for
    assert units[0].startswith("train samples/s") and len(units) == 1 + 2 * 4
    for name in ("fp32-eager", "fp32-onnx", "int8-static", "int8-openvino"):
        assert sum(u.startswith(f"{name} ") for u in units) == 2, units
    for row in result["rows"]:
        assert set(row["by_threads"]) == {"1", "2"} and all(v["value"] > 0 for v in row["by_threads"].values())
        assert row["by_threads"]["1"]["speedup"] == 1.0
    assert result["threads"] == [1, 2] and result["machine"]["cpu"] and "threads.cap" in result["thread_settings"]
