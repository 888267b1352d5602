"""Unit: the measuring code (percentiles, alternation, paired speed-up intervals, inputs); no timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import BenchmarkParams
from pipeline.evaluation.latency import (
    Apart,
    Speedup,
    alternating_schedule,
    latency_inputs,
    measure,
    percentiles,
    speedup,
    speedup_interval,
    throughput_batches,
)


def test_percentiles_match_definition():
    p = percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles(list(range(1, 100)))["p99"] is None  # 99 samples: no tail estimate, so none reported
    with pytest.raises(ValueError):
        percentiles([])
    # an array of samples (as benchmarks.serve_load holds them) gives the same figures; an empty one is refused
    assert percentiles(np.arange(1, 101, dtype=np.float64)) == p
    with pytest.raises(ValueError):
        percentiles(np.array([]))


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


class Paced(Recorder):
    """A fake runner whose calls take `ms` (a clock it advances, not real time): which rows are apart is decided
    by their timings."""

    def __init__(self, name: str, log: list, ms: float, clock: list) -> None:
        super().__init__(name, log)
        self.ms, self.clock = ms, clock

    def __call__(self, ids, mask):
        self.clock[0] += self.ms / 1e3
        return super().__call__(ids, mask)


def _paced(monkeypatch, speeds: dict[str, float]) -> tuple[dict, list]:
    import pipeline.evaluation.latency as latency

    clock, calls = [0.0], []
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(latency.time, "sleep", lambda s: None)
    return {n: Paced(n, calls, ms, clock) for n, ms in speeds.items()}, calls


def test_a_row_clearly_slower_than_every_contender_stops_after_its_rounds(monkeypatch):
    """`Apart`: after two rounds the slow FP32 row (every round slower than every INT8 row's slowest) is not
    visited again; the reference and the INT8 rows run every round, and a row whose rounds overlap theirs too."""
    runners, calls = _paced(monkeypatch, {"ref": 40.0, "slow": 20.0, "close": 6.0, "int8-a": 5.0, "int8-b": 7.0})
    lat = [(np.zeros((1, 8), np.int64), np.ones((1, 8), np.int64))] * 4
    tp = [(np.zeros((4, 8), np.int64), np.ones((4, 8), np.int64))]
    ticks: list = []
    apart = Apart(rows=frozenset({"slow", "close"}), against=frozenset({"int8-a", "int8-b"}), after_rounds=2)
    out = measure(runners, lat, tp, BenchmarkParams(warmup=1, iterations=8, rounds=4), progress=ticks.append,
                  apart=apart)
    assert {n: out[n]["rounds"] for n in out} == {"ref": 4, "slow": 2, "close": 4, "int8-a": 4, "int8-b": 4}
    assert out["slow"]["latency_samples"] == 4 and len(out["slow"]["latency_rounds_ms"]) == 2
    timed = [name for name, size in calls[2 * len(runners):] if size == 1]  # after the first warm-up
    assert timed.count("slow") == 2 * (1 + 2) and timed.count("ref") == 4 * (1 + 2)  # warm-up + timed, per round
    assert len(ticks) == 4 * len(runners)  # the progress bar still ends at rounds x rows
    assert measure(runners, lat, tp, BenchmarkParams(warmup=1, iterations=8, rounds=4))["slow"]["rounds"] == 4


def test_nothing_stops_without_a_contender_or_before_its_rounds():
    rounds = {"slow": [[20.0, 21.0]], "fast": [[5.0]]}
    assert Apart(frozenset({"slow"}), frozenset({"fast"}), after_rounds=2).settled(rounds) == set()
    assert Apart(frozenset({"slow"}), frozenset({"fast"}), after_rounds=1).settled(rounds) == {"slow"}
    assert Apart(frozenset({"slow"}), frozenset({"none-timed"}), after_rounds=1).settled(rounds) == set()
    # one round of the slow row as fast as the contenders' slowest: not clearly apart
    assert Apart(frozenset({"slow"}), frozenset({"fast"}), after_rounds=1).settled(
        {"slow": [[20.0], [6.0]], "fast": [[5.0], [6.0]]}) == set()


def test_a_row_timed_in_fewer_rounds_pairs_with_the_references_first_rounds():
    ref = {"p50_ms_b1": 30.0, "latency_rounds_ms": [[10.0, 10.0], [20.0, 20.0], [90.0, 90.0]]}
    short = {"p50_ms_b1": 7.5, "latency_rounds_ms": [[5.0, 5.0], [10.0, 10.0]]}
    gain = speedup(ref, short)
    assert gain.p50 == pytest.approx(15.0 / 7.5) and gain.low == pytest.approx(2.0) and gain.high == pytest.approx(2.0)


def test_each_round_of_a_variant_waits_settle_s_before_its_warm_up(monkeypatch):
    """The previous variant's idle runtime threads spin on after its last call: each visit waits
    `benchmark.settle_s` with no call in flight, then warms up, then is timed."""
    import pipeline.evaluation.latency as latency

    events: list = []
    monkeypatch.setattr(latency.time, "sleep", lambda s: events.append(("sleep", s)))
    runners = {n: Recorder(n, events) for n in ("a", "b")}
    lat = [(np.zeros((1, 16), np.int64), np.ones((1, 16), np.int64))] * 3
    tp = [(np.zeros((4, 16), np.int64), np.ones((4, 16), np.int64))]
    measure(runners, lat, tp, BenchmarkParams(warmup=1, iterations=2, rounds=2, settle_s=0.07))
    visits = events[2 * (1 + 1):]  # after the first warm-up: 1 latency + 1 throughput call per runner
    # a visit: the pause, 1 warm-up call, 1 timed call, 1 throughput batch
    assert [e[0] for e in visits] == ["sleep", "a", "a", "a", "sleep", "b", "b", "b"] * 2
    assert {s for kind, s in visits if kind == "sleep"} == {0.07}


def test_every_variant_is_timed_on_the_same_reviews_in_a_round():
    seen: dict[str, list[list[int]]] = {"a": [], "b": [], "c": []}

    def runner(name: str):
        def run(ids, mask):
            if ids.shape[0] == 1:
                seen[name][-1].append(int(ids[0, 0]))
            return np.zeros((ids.shape[0], 2), dtype=np.float32)
        return run

    class Rounds(dict):  # a new list of inputs for each visit: warm-up and timed calls of one visit together
        def __getitem__(self, name):
            seen[name].append([])
            return super().__getitem__(name)

    lat = [(np.full((1, 8), i, np.int64), np.ones((1, 8), np.int64)) for i in range(7)]
    tp = [(np.zeros((4, 8), np.int64), np.ones((4, 8), np.int64))]
    runners = Rounds({n: runner(n) for n in seen})
    measure(runners, lat, tp, BenchmarkParams(warmup=1, iterations=9, rounds=3))
    visits = {name: calls[-3:] for name, calls in seen.items()}  # the three rounds (earlier: the first warm-up)
    assert visits["a"] == visits["b"] == visits["c"] == [[0, 0, 1, 2], [3, 3, 4, 5], [6, 6, 0, 1]]


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


def test_latency_inputs_are_real_reviews_of_exactly_seq_len_tokens_never_padded():
    """A padded input would be timed shorter for a variant that scores rows unpadded than for the others."""
    seqs = [np.arange(1, 200), np.arange(1, 10), np.arange(3, 131), np.arange(5, 300)]
    inputs = latency_inputs(seqs, 128, 2, pad_id=0)
    assert [ids[0, 0] for ids, _ in inputs] == [1, 3]  # the short review is passed over
    assert all(ids.shape == (1, 128) and mask.sum() == 128 for ids, mask in inputs)
    assert len(latency_inputs(seqs, 128, 10, pad_id=0)) == 3  # as many as there are
    with pytest.raises(ValueError, match="longest test review has 295"):
        latency_inputs(seqs, 300, 2, pad_id=0)


def test_throughput_batches_use_dynamic_padding():
    seqs = [np.arange(1, n) for n in (5, 9, 20, 7)]
    batches = throughput_batches(seqs, 2, 5, 0)
    assert [b[0].shape for b in batches] == [(2, 8), (2, 19)]


def test_a_test_split_smaller_than_one_throughput_batch_names_the_settings(tiny_model_dir, tokenized_dir):
    """Fewer test reviews than `benchmark.batch_size` leave no full batch to time: an error that names both
    settings, before any variant is loaded, instead of an IndexError from the first batch (`measure`, memory)."""
    from pipeline.core.errors import UserError
    from pipeline.core.machine import Choice
    from pipeline.evaluation.benchmark import run_benchmark

    seqs = [np.arange(1, n) for n in (5, 9, 20)]
    with pytest.raises(UserError, match=r"benchmark\.batch_size is 4 reviews, but the test split has 3 "
                                        r"\(data.test_subsample\)"):
        throughput_batches(seqs, 4, 1, 0)
    params = BenchmarkParams(seq_len=16, batch_size=64, warmup=1, iterations=1, rounds=1, latency_reviews=1,
                             threads=1)  # tokenized_dir's test split: 32 reviews
    with pytest.raises(UserError, match=r"benchmark\.batch_size is 64 reviews, but the test split has 32"):
        run_benchmark(finetuned=tiny_model_dir, variant_dirs={}, tokenized=tokenized_dir, params=params,
                      bf16=Choice("benchmark.bf16_row", False, False, "set explicitly"))


def test_speedup_is_the_reference_p50_over_the_rows_with_the_paired_interval():
    ref = {"p50_ms_b1": 10.0, "latency_rounds_ms": [[10.0, 10.0], [9.0, 11.0], [10.0, 10.0]]}
    row = {"p50_ms_b1": 5.0, "latency_rounds_ms": [[5.0, 5.0], [4.5, 5.5], [5.0, 5.0]]}
    gain = speedup(ref, row)
    assert gain.p50 == 2.0 and gain.low <= 2.0 <= gain.high
    assert speedup(ref, ref) == Speedup(1.0, 1.0, 1.0)


@pytest.mark.parametrize("bf16", [True, False])
def test_the_bf16_row_is_timed_exactly_when_the_choice_asks(tiny_model_dir, tokenized_dir, bf16):
    """`benchmark.bf16_row` resolved True times the FP32 model under bf16 autocast beside the reference (whatever the
    CPU: an explicit request is honoured, emulated or not); False leaves the row out. The miniature `dvc repro` runs
    with the default (auto), which an AVX2-only CPU resolves to False, so this is where the row itself is run."""
    from pipeline.core.machine import Choice
    from pipeline.evaluation.benchmark import run_benchmark
    from pipeline.runtimes.catalog import BF16_ROW, MKL_ROW, READOUT_ROW, REFERENCE
    from pipeline.runtimes.fp32_linear import resolve_fp32_linear

    params = BenchmarkParams(seq_len=16, batch_size=4, warmup=1, iterations=2, rounds=2, latency_reviews=2,
                             threads=1, memory=False)
    choice = Choice("benchmark.bf16_row", True if bf16 else "auto", bf16, "set explicitly" if bf16 else "no bf16")
    result = run_benchmark(finetuned=tiny_model_dir, variant_dirs={}, tokenized=tokenized_dir, params=params,
                           bf16=choice)
    rows = result["variants"]
    mkl = {MKL_ROW} if resolve_fp32_linear("auto").value == "onednn" else set()  # this CPU's FP32 kernel choice
    assert set(rows) == {REFERENCE, READOUT_ROW} | ({BF16_ROW} if bf16 else set()) | mkl
    assert result["settings"]["bf16_row"] is bf16 and result["settings"]["bf16_row_choice"] == choice.tag()
    if bf16:
        row = rows[BF16_ROW]
        assert row["status"] == "ok" and row["latency_samples"] == 2, row
        assert row["p50_ms_b1"] > 0 and row["throughput_b32"] > 0 and row["speedup_p50_low"] > 0, row


def test_a_null_benchmark_thread_setting_uses_the_cpus_this_process_may_run_on(tiny_model_dir, tokenized_dir,
                                                                                monkeypatch):
    """`benchmark.threads: null` without an OMP cap times with one thread per CPU of the affinity mask (a `taskset`
    or container cpuset), not one per CPU of the machine, and records that count."""
    import torch

    from pipeline.core import machine
    from pipeline.core.machine import Choice
    from pipeline.evaluation.benchmark import run_benchmark

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 64)
    params = BenchmarkParams(seq_len=16, batch_size=4, warmup=1, iterations=1, rounds=1, latency_reviews=1,
                             memory=False)
    before = torch.get_num_threads()
    try:
        result = run_benchmark(finetuned=tiny_model_dir, variant_dirs={}, tokenized=tokenized_dir, params=params,
                               bf16=Choice("benchmark.bf16_row", False, False, "set explicitly"))
        assert result["machine"]["threads_used"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_each_variants_memory_is_read_from_a_process_of_its_own(built, tmp_path):
    """`peak_rss_of_each`: one probe process per variant (`pipeline.evaluation.memory_probe`), which loads only the
    runtime it needs: an ONNX variant's probe imports no torch, so it peaks below the eager model's."""
    from pipeline.evaluation.latency import peak_rss_mb, peak_rss_of_each

    batch = (np.full((4, 16), 1000, dtype=np.int64), np.ones((4, 16), dtype=np.int64))
    rss = peak_rss_of_each({n: (built["dirs"][n], {}) for n in ("int8-dynamic", "fp32-torchscript")}, batch, 1)
    assert set(rss) == {"int8-dynamic", "fp32-torchscript"} and all(v > 20 for v in rss.values())
    assert rss["int8-dynamic"] < rss["fp32-torchscript"]  # no torch in the ONNX Runtime probe
    with pytest.raises(RuntimeError, match="memory probe failed"):
        peak_rss_mb(tmp_path, {}, batch, 1)


def test_result_rows_hold_each_candidates_timings_scores_and_the_speed_pairs(tmp_path):
    """`result_rows` (the row assembly of `run_benchmark`): skipped rows keep their reason, measured ones their
    timings (the samples by round stay out), speed-up over FP32 eager with its interval (none for the reference
    itself), peak RSS where probed and evaluate's scores; the QAT variant its paired interval against its runtime's
    post-training variant, a static-scale recipe against int8-dynamic (and only where both were timed)."""
    from pipeline.evaluation.benchmark import result_rows
    from pipeline.evaluation.latency import Candidate

    def timed(p50: float) -> dict:
        return {"p50_ms_b1": p50, "p95_ms_b1": p50, "p99_ms_b1": None, "throughput_b32": 100 / p50,
                "latency_samples": 4, "latency_rounds_ms": [[p50, p50], [p50, p50]]}

    cands = [Candidate("fp32-eager", tmp_path, {}), Candidate("int8-openvino", tmp_path, {}, weight_format="s8"),
             Candidate("int8-qat-openvino", tmp_path, {}), Candidate("int8-dynamic", tmp_path, {}),
             Candidate("int8-qat", tmp_path, {}), Candidate("int8-static", tmp_path, {}, "skipped", "not built")]
    timings = {"fp32-eager": timed(10.0), "int8-openvino": timed(2.5), "int8-qat-openvino": timed(2.0),
               "int8-dynamic": timed(4.0), "int8-qat": timed(5.0)}
    rows = result_rows(cands, timings, {"int8-openvino": 300.0},
                       {"int8-openvino": {"accuracy": 0.9, "size_mb": 20.0, "model_id": "m-1"}})
    assert list(rows) == ["fp32-eager", "int8-openvino", "int8-qat-openvino", "int8-dynamic", "int8-qat", "int8-static"]
    assert rows["int8-static"] == {"status": "skipped", "reason": "not built"}
    assert rows["fp32-eager"]["speedup_p50_vs_fp32_eager"] == 1.0 and "speedup_p50_low" not in rows["fp32-eager"]
    openvino = rows["int8-openvino"]
    assert (openvino["speedup_p50_vs_fp32_eager"], openvino["speedup_p50_low"], openvino["weight_format"]) == (
        4.0, 4.0, "s8")
    assert (openvino["peak_rss_mb"], openvino["accuracy"], openvino["size_mb"]) == (300.0, 0.9, 20.0)
    assert "latency_rounds_ms" not in openvino and "model_id" not in openvino and "b1_vs_baseline_low" not in openvino
    assert rows["int8-qat-openvino"]["b1_vs_baseline_low"] == rows["int8-qat-openvino"]["b1_vs_baseline_high"] == 1.25
    assert rows["int8-qat"]["b1_vs_baseline_low"] == rows["int8-qat"]["b1_vs_baseline_high"] == 0.8  # vs int8-dynamic
    assert "b1_vs_baseline_low" not in rows["int8-dynamic"] and "b1_vs_baseline_low" not in rows["int8-static"]


def _fp32_kernel(monkeypatch, value: str) -> None:
    """The FP32 `Linear` kernel `candidates` sees this CPU pick, whatever CPU runs the test."""
    from pipeline.core.machine import Choice

    monkeypatch.setattr("pipeline.evaluation.latency.resolve_fp32_linear",
                        lambda asked="auto": Choice("fp32_linear", asked, value, "this test's CPU"))


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_pytorchs_own_fp32_products_are_timed_beside_the_reference_where_it_runs_onednns(built, tiny_model_dir,
                                                                                         monkeypatch, kernel):
    """Where this CPU runs fp32-eager's `Linear` layers on oneDNN (`pipeline.runtimes.fp32_linear`), the benchmark
    also times PyTorch's own call (MKL's sgemm), so the kernel's share of every speed-up is on the page; where the
    reference already runs PyTorch's own call, the row would time the same thing twice and is left out."""
    from pipeline.evaluation.latency import candidates
    from pipeline.runtimes.catalog import MKL_ROW, TIMING_ROWS

    _fp32_kernel(monkeypatch, kernel)
    rows = {c.name: c for c in candidates(tiny_model_dir, {}, include_bf16=False)}
    assert MKL_ROW in TIMING_ROWS
    if kernel == "onednn":
        assert rows[MKL_ROW].status == "ok" and rows[MKL_ROW].options == {"fp32_linear": "torch"}
        from pipeline.runtimes.registry import load_runner

        assert load_runner(tiny_model_dir, **rows[MKL_ROW].options).describe()["fp32_linear"] == "torch"
    else:
        assert MKL_ROW not in rows


def test_the_readout_row_is_timed_only_where_a_built_variant_has_the_readout(built, tiny_model_dir, monkeypatch):
    """The eager [CLS]-readout row splits the readout's share off the exported variants' speed-up: with none of
    them computing the [CLS] position only (`export.cls_readout: false`, or nothing built) it is skipped, saying
    why, instead of timing a model nothing serves."""
    from pipeline.evaluation.latency import candidates

    _fp32_kernel(monkeypatch, "torch")
    from pipeline.runtimes.catalog import READOUT_ROW, REFERENCE
    from pipeline.runtimes.record import read_variant

    onnx_dir = built["dirs"]["fp32-onnx"]
    assert read_variant(onnx_dir).params["cls_readout"] is True  # the tiny build exports with the readout
    rows = {c.name: c for c in candidates(tiny_model_dir, {"fp32-onnx": onnx_dir}, include_bf16=False)}
    assert rows[READOUT_ROW].status == "ok" and rows[READOUT_ROW].options == {"cls_readout": True}
    alone = {c.name: c for c in candidates(tiny_model_dir, {}, include_bf16=False)}
    assert alone[READOUT_ROW].status == "skipped" and "computes the [CLS] position only" in alone[READOUT_ROW].reason
    # timing a few variants (`python -m pipeline.evaluation.benchmark --variants ...`): every built one decides
    chosen = {c.name: c for c in candidates(tiny_model_dir, {}, include_bf16=False, built={"fp32-onnx": onnx_dir})}
    assert chosen[READOUT_ROW].status == "ok" and set(chosen) == {REFERENCE, READOUT_ROW}


def test_the_benchmark_lets_only_rows_it_never_serves_stop_early():
    from pipeline.evaluation.benchmark import apart_rows

    names = ["fp32-eager", "fp32-eager-bf16", "fp32-eager-readout", "fp32-torchscript", "fp32-onnx", "int8-dynamic",
             "int8-qat-openvino", "fp32-distilled", "int8-distilled"]
    apart = apart_rows(names, 3)
    assert apart.after_rounds == 3
    assert apart.against == {"int8-dynamic", "int8-qat-openvino", "int8-distilled"}
    assert apart.rows == {"fp32-eager-bf16", "fp32-eager-readout", "fp32-torchscript", "fp32-onnx", "fp32-distilled"}
    assert apart_rows(names, None) is None
