"""Unit: the measuring code (percentiles, alternation, threads, skipped rows); no timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.machine import machine_info
from pipeline.core.params import BenchmarkParams
from pipeline.evaluation.latency import (
    alternating_schedule,
    latency_inputs,
    measure,
    percentiles,
    speedup_interval,
    throughput_batches,
)
from pipeline.evaluation.report import markdown_table, target_lines


def test_percentiles_match_definition():
    p = percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    with pytest.raises(ValueError):
        percentiles([])


def test_schedule_alternates():
    assert alternating_schedule(["a", "b", "c"], 2) == ["a", "b", "c", "a", "b", "c"]


class Recorder:
    """A fake runner that logs who was called, in order, with which batch size."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __call__(self, ids, mask):
        self.log.append((self.name, ids.shape[0]))
        return np.zeros((ids.shape[0], 2), dtype=np.float32)


def test_measure_alternates_and_counts():
    calls: list = []
    runners = {n: Recorder(n, calls) for n in ("a", "b")}
    lat = [(np.zeros((1, 16), np.int64), np.ones((1, 16), np.int64))] * 3
    tp = [(np.zeros((4, 16), np.int64), np.ones((4, 16), np.int64))] * 2
    params = BenchmarkParams(warmup=2, iterations=6, rounds=3)
    out = measure(runners, lat, tp, params)
    rounds = calls[2 * (2 + 1):]  # after warm-up: 2 latency + 1 throughput call per runner
    # each round: 2 untimed warm-up calls, 2 timed latency calls, 2 throughput batches for one runner, then the next
    assert [name for name, _ in rounds] == (["a"] * 6 + ["b"] * 6) * 3
    assert [size for _, size in rounds[:6]] == [1, 1, 1, 1, 4, 4]
    for name in ("a", "b"):
        assert out[name]["latency_samples"] == 6
        assert out[name]["p50_ms_b1"] >= 0 and out[name]["throughput_b32"] > 0
        assert [len(r) for r in out[name]["latency_rounds_ms"]] == [2, 2, 2]  # by round, for the interval


def test_speedup_interval_is_paired_by_round():
    # the machine drifts 2x between rounds, but within a round the variant is always 2.5x faster: pairing
    # by round cancels the drift, so the interval is exactly 2.5x
    rng = np.random.default_rng(0)
    ref = [list(40.0 * drift * (1 + 0.01 * rng.random(10))) for drift in (1.0, 1.3, 2.0, 0.9, 1.1)]
    var = [[x / 2.5 for x in r] for r in ref]
    low, high = speedup_interval(ref, var)
    assert low == pytest.approx(2.5) and high == pytest.approx(2.5)
    # when the ratio itself moves between rounds, the interval covers those ratios and no more
    var = [[x / f for x in r] for r, f in zip(ref, (2.0, 2.2, 2.4, 2.6, 2.8), strict=True)]
    low, high = speedup_interval(ref, var)
    assert 2.0 <= low < 2.4 < high <= 2.8
    with pytest.raises(ValueError):
        speedup_interval(ref, var[:3])


def test_latency_inputs_have_exact_length():
    seqs = [np.arange(1, 200), np.arange(1, 10)]
    inputs = latency_inputs(seqs, 128, 2, pad_id=0)
    assert all(ids.shape == (1, 128) for ids, _ in inputs)
    assert inputs[0][1].sum() == 128 and inputs[1][1].sum() == 9


def test_throughput_batches_use_dynamic_padding():
    seqs = [np.arange(1, n) for n in (5, 9, 20, 7)]
    batches = throughput_batches(seqs, 2, 5, 0)
    assert [b[0].shape for b in batches] == [(2, 8), (2, 19)]


def test_thread_settings_are_honoured(tiny_model_dir):
    import torch

    from pipeline.variants.runners import load_runner

    before = torch.get_num_threads()
    try:
        load_runner(tiny_model_dir, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    info = machine_info(threads=1)
    assert info["threads_used"] == 1 and "avx2" in info["isa"]


def test_ort_session_threads(tmp_path, tiny_model_dir):
    from pipeline.modeling import load_finetuned
    from pipeline.variants.export import export_onnx
    from pipeline.variants.runners import OrtRunner

    model, _, _ = load_finetuned(tiny_model_dir)
    export_onnx(model, tmp_path / "m.onnx", 32)
    runner = OrtRunner(tmp_path / "m.onnx", threads=1)
    assert runner.session.get_session_options().intra_op_num_threads == 1


def _row(p50: float, acc: float | None = 0.9) -> dict:
    return {"status": "ok", "reason": "", "p50_ms_b1": p50, "p95_ms_b1": p50 * 1.2, "p99_ms_b1": p50 * 1.5,
            "throughput_b32": 100 / p50, "speedup_p50_vs_fp32_eager": 10 / p50, "accuracy": acc, "size_mb": 20.0}


def test_skipped_rows_and_targets_in_report():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "tensorrt-int8": {"status": "skipped", "reason": "no CUDA device visible"}}
    table = markdown_table(variants)
    assert "| tensorrt-int8 | skipped: no CUDA device visible |" in table
    assert "2.50x" in table
    (line,) = target_lines(variants)
    # int8-dynamic is faster but loses 5 pt, so the eligible best is int8-static at 2.5x: a miss
    assert "int8-static" in line and "2.50x" in line and "MISSED" in line


def test_speedup_interval_in_table_and_target_line():
    variants = {"fp32-eager": _row(10.0), "int8-dynamic": _row(3.5, 0.898)}
    variants["int8-dynamic"].update(speedup_p50_low=2.6, speedup_p50_high=3.1)
    table = markdown_table(variants)
    assert "2.86x (2.60-3.10)" in table and "90 % interval" in table
    (line,) = target_lines(variants)
    assert "MISSED" in line and "2.60-3.10x" in line and "straddles 3.0x" in line
    variants["int8-dynamic"].update(speedup_p50_high=2.9)
    assert "straddles" not in target_lines(variants)[0]


def test_pruned_variant_target_stated_apart_from_quantization_alone():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "int8-pruned": _row(3.0, 0.897)}
    overall, plain = target_lines(variants)
    assert "**int8-pruned** (structured pruning + INT8" in overall and "3.33x" in overall and "met" in overall
    assert "-0.30 pt" in overall
    assert plain.startswith("quantization alone (no pruning): ")
    assert "int8-static" in plain and "2.50x" in plain and "MISSED" in plain


def test_gemm_ceiling_products_compute_the_same_product():
    """The three single-node graphs of `benchmarks.int8_gemm_ceiling` compute x @ W in their arithmetic."""
    import onnxruntime as ort
    from onnx import load_from_string, numpy_helper

    from benchmarks.int8_gemm_ceiling import single_node_model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    out = {}
    for kind in ("fp32", "int8"):
        blob = single_node_model(kind, 32, 16)
        out[kind] = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w = numpy_helper.to_array(load_from_string(single_node_model("fp32", 32, 16)).graph.initializer[0])
    np.testing.assert_allclose(out["fp32"], x @ w, rtol=1e-5, atol=1e-5)
    assert np.abs(out["int8"] - out["fp32"]).max() < 0.05 * np.abs(out["fp32"]).max()  # quantization error only
    xu = rng.integers(0, 256, (8, 32)).astype(np.uint8)
    blob = single_node_model("int8-gemm-only", 32, 16)
    w8 = numpy_helper.to_array(load_from_string(blob).graph.initializer[0]).astype(np.int64)
    got = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": xu})[0]
    np.testing.assert_array_equal(got, (xu.astype(np.int64) - 128) @ w8)  # 7-bit weights: exact
    with pytest.raises(ValueError, match="unknown kind"):
        single_node_model("fp16", 4, 4)
