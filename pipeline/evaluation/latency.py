"""Latency, throughput and memory of every variant, measured the same way, alternating between variants."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import UserError
from pipeline.core.machine import available_cpus
from pipeline.core.params import BenchmarkParams
from pipeline.evaluation import memory_probe
from pipeline.runtimes.base import Runner, pad_batch
from pipeline.runtimes.catalog import BF16_ROW, MKL_ROW, READOUT_ROW, REFERENCE
from pipeline.runtimes.fp32_linear import resolve_fp32_linear
from pipeline.runtimes.record import read_variant

log = logging.getLogger(__name__)


SPEEDUP_LEVEL = 0.9  # the speed-up interval's coverage (`speedup_interval`)


class BenchmarkInputError(UserError, ValueError):
    """The test split cannot feed the benchmark as its settings ask (no review as long as `benchmark.seq_len`, fewer
    reviews than one batch of `benchmark.batch_size`); the message names the settings to change."""


#: Fewest samples a p99 is reported from: below it the 99th percentile is an interpolation between the largest
#: two samples, not a tail estimate.
P99_MIN_SAMPLES = 100


def percentiles(samples_ms: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 with linear interpolation (numpy's default), in ms; p99 is None under `P99_MIN_SAMPLES`."""
    a = np.asarray(samples_ms, dtype=np.float64)  # a list or an array (`benchmarks.serve_load` passes one)
    if a.size == 0:
        raise ValueError("no latency samples")
    p99 = float(np.percentile(a, 99)) if len(a) >= P99_MIN_SAMPLES else None
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "p99": p99}


def speedup_interval(reference_rounds: Sequence[Sequence[float]], rounds: Sequence[Sequence[float]],
                     level: float = SPEEDUP_LEVEL, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of p50(reference) / p50(variant) that resamples whole rounds, paired.

    On a shared machine the reference's p50 moves by tens of percent between runs; one ratio hides that.
    Within a round both rows were measured minutes apart at most, so rounds are the unit that is resampled
    (the same picks for both rows), and the interval shows how far drift between rounds moves the ratio.
    """
    if not rounds or len(reference_rounds) != len(rounds):
        raise ValueError("reference and variant need the same, non-zero number of rounds")
    ref = [np.asarray(r, dtype=np.float64) for r in reference_rounds]
    var = [np.asarray(r, dtype=np.float64) for r in rounds]
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    for i in range(resamples):
        pick = rng.integers(0, len(rounds), len(rounds))
        ref_p50 = np.median(np.concatenate([ref[j] for j in pick]))
        ratios[i] = ref_p50 / np.median(np.concatenate([var[j] for j in pick]))
    tail = 100 * (1 - level) / 2
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


@dataclass(frozen=True)
class Speedup:
    """How many times faster a row is than the reference at batch 1: p50(reference) / p50(row), and the paired
    bootstrap interval of that ratio over rounds (`speedup_interval`)."""

    p50: float
    low: float
    high: float


def speedup(reference: Mapping[str, Any], timed: Mapping[str, Any], level: float = SPEEDUP_LEVEL) -> Speedup:
    """The speed-up of `timed` over `reference`, two rows of `measure`'s timings (`p50_ms_b1`, `latency_rounds_ms`):
    the one place that ratio and its interval are computed. A row that `measure` stopped early (`Apart`) is paired
    with the reference's rounds it was timed in, the first ones: the ratio too is over those rounds."""
    if timed is reference:
        return Speedup(1.0, 1.0, 1.0)
    ref_rounds, rounds = reference["latency_rounds_ms"], timed["latency_rounds_ms"]
    if len(rounds) < len(ref_rounds):
        ref_rounds = ref_rounds[: len(rounds)]
        ref_p50 = percentiles([x for samples in ref_rounds for x in samples])["p50"]  # as `measure` takes p50
    else:
        ref_p50 = reference["p50_ms_b1"]
    low, high = speedup_interval(ref_rounds, rounds, level)
    return Speedup(ref_p50 / timed["p50_ms_b1"], low, high)


def alternating_schedule(names: Sequence[str], rounds: int) -> list[str]:
    """A B C A B C ...: every round visits every variant once, so drift hits all alike."""
    return [name for _ in range(rounds) for name in names]


@dataclass(frozen=True)
class Apart:
    """Which rows `measure` may stop timing early: after `after_rounds` rounds, each of `rows` whose fastest round
    (its p50 in that round) is slower than the slowest round of every row in `against` is clearly apart from them
    and is not visited again. The benchmark stage passes the rows the package stage never serves (FP32 exports,
    the timing rows) against the INT8 variants it chooses among; FP32 eager, every speed-up's reference, is in
    neither and runs every round."""

    rows: frozenset[str]
    against: frozenset[str]
    after_rounds: int

    def settled(self, rounds_ms: Mapping[str, list[list[float]]]) -> set[str]:
        """The rows of `rows` clearly slower than all of `against`, from the rounds timed so far."""
        contenders = [rounds_ms[n] for n in self.against if rounds_ms.get(n)]
        if not contenders:
            return set()
        slowest = max(float(np.median(r)) for rounds in contenders for r in rounds)
        return {n for n in self.rows if len(rounds_ms.get(n, [])) >= self.after_rounds
                and min(float(np.median(r)) for r in rounds_ms[n]) > slowest}


@dataclass
class Candidate:
    """A variant to measure: how to build its runner and where it lives."""

    name: str
    directory: Path
    options: dict[str, Any]
    status: str = "ok"
    reason: str = ""
    cls_readout: bool = False  # the variant's last layer computes the [CLS] position only (`pipeline.runtimes.readout`)
    weight_format: str | None = None  # an INT8 variant's weight format (`quantize.weight_format`), from its record


def candidates(finetuned: Path, variant_dirs: dict[str, Path], include_bf16: bool,
               built: dict[str, Path] | None = None) -> list[Candidate]:
    """FP32 eager first (the reference), the bf16-autocast row, the row of PyTorch's own FP32 products where the
    reference runs oneDNN's (`pipeline.runtimes.fp32_linear`), the eager [CLS]-readout row (the readout's own
    share of the exported variants' speed-up: skipped, with its reason, where no variant `built` (default: those
    in `variant_dirs`; a caller timing a few passes every built one) computes the [CLS] position only, as with
    `export.cls_readout: false`), then every variant in `variant_dirs` (skipped ones kept)."""
    infos = {name: read_variant(d) for name, d in variant_dirs.items()}
    variants = [Candidate(name, d, {}, infos[name].status, infos[name].reason,
                          bool(infos[name].params.get("cls_readout", False)), infos[name].params.get("weight_format"))
                for name, d in variant_dirs.items()]
    out = [Candidate(REFERENCE, finetuned, {})]
    if include_bf16:
        out.append(Candidate(BF16_ROW, finetuned, {"autocast": "bf16"}))
    if resolve_fp32_linear("auto").value == "onednn":  # fp32-eager runs oneDNN's products: PyTorch's own beside it
        out.append(Candidate(MKL_ROW, finetuned, {"fp32_linear": "torch"}))
    readout = Candidate(READOUT_ROW, finetuned, {"cls_readout": True}, cls_readout=True)
    # the records already read where `built` is the same set (the benchmark stage): each read once
    built_infos = infos.values() if built is None else [infos.get(n) or read_variant(d) for n, d in built.items()]
    records = [info for info in built_infos if info.status == "ok"]
    if not any(info.params.get("cls_readout", False) for info in records):
        # the built variants' own reason for having no readout, as they recorded it
        why_not = next((str(i.params["cls_readout_reason"]) for i in records if i.params.get("cls_readout_reason")), "")
        readout.status = "skipped"
        readout.reason = "no built variant computes the [CLS] position only" + (f": {why_not}" if why_not else "")
    return [*out, readout, *variants]


def latency_inputs(seqs: Sequence[np.ndarray], seq_len: int, count: int, pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """Batch-1 inputs of exactly `seq_len` real tokens: the first `count` reviews at least that long, truncated to
    it. None is padded: a variant that scores each review unpadded (`batching: rows`) would drop the padding and
    be timed on a shorter input than the others. `measure` cycles through fewer inputs when fewer reviews are that
    long."""
    full = [s[:seq_len] for s in seqs if len(s) >= seq_len][:count]
    if not full:
        longest = max((len(s) for s in seqs), default=0)
        raise BenchmarkInputError(f"benchmark.seq_len is {seq_len} tokens, but the longest test review has {longest}: "
                                  "lower benchmark.seq_len to at most the reviews' length")
    return [pad_batch([s], pad_id, seq_len) for s in full]


def throughput_batches(seqs: Sequence[np.ndarray], batch: int, n_batches: int,
                       pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """Batches of real reviews in test-split order, each padded to its own longest review: the first `n_batches`
    full batches of `batch` reviews, fewer where the split holds fewer (`measure` times those it gets), and an
    error naming the settings where it holds less than one (every throughput figure is at `batch` reviews)."""
    if len(seqs) < batch:
        raise BenchmarkInputError(f"benchmark.batch_size is {batch} reviews, but the test split has {len(seqs)} "
                                  "(data.test_subsample): lower benchmark.batch_size to at most the split's size or "
                                  "raise data.test_subsample")
    return [pad_batch(list(seqs[i * batch : (i + 1) * batch]), pad_id) for i in range(n_batches)
            if len(seqs[i * batch : (i + 1) * batch]) == batch]


def measure(runners: dict[str, Runner], lat_inputs: list[tuple[np.ndarray, ...]],
            tp_batches: list[tuple[np.ndarray, ...]], params: BenchmarkParams,
            progress: Callable[[str], None] | None = None, apart: Apart | None = None) -> dict[str, dict[str, Any]]:
    """Warm up each runner, then alternate rounds of batch-1 latency and batch-N throughput.

    Every round starts with `params.settle_s` seconds idle and `params.warmup` untimed calls: right after another
    variant ran, its runtime's threads go on spinning for a while and the caches hold its weights, so the first
    calls are slower than the steady state, and with few timed calls per round they would be a sizeable share of
    the samples, inflating p95 and nudging p50.
    Each row keeps its latency samples by round (`latency_rounds_ms`) for `speedup_interval`; with `apart`, a row
    clearly slower than those it is compared with stops after that many rounds (`rounds` says how many it ran)."""
    names = list(runners)
    for name in names:
        for i in range(params.warmup):
            runners[name](*lat_inputs[i % len(lat_inputs)])
        runners[name](*tp_batches[0])
    lat: dict[str, list[list[float]]] = {n: [] for n in names}  # one list of samples per round
    tp: dict[str, list[float]] = {n: [] for n in names}
    per_round = max(1, params.iterations // params.rounds)
    stopped: set[str] = set()
    for r, name in enumerate(alternating_schedule(names, params.rounds)):
        if r % len(names) == 0 and apart is not None:  # a round starts: leave out the rows already clearly apart
            stopped |= apart.settled(lat)
        if name in stopped:
            if progress:
                progress(name)
            continue
        run = runners[name]
        lat[name].append([])
        first = (r // len(names)) * per_round  # by round: every variant is timed on the same reviews in a round
        # the previous variant's idle threads spin on: calls made meanwhile share the cores with them (warm-up calls
        # alone did not wait them out: the first timed calls of one onnxruntime session after another ran slow)
        time.sleep(params.settle_s)
        for i in range(params.warmup):  # the first calls after another variant ran are cold (caches)
            run(*lat_inputs[(first + i) % len(lat_inputs)])
        for i in range(per_round):
            ids, mask = lat_inputs[(first + i) % len(lat_inputs)]
            t = time.perf_counter()
            run(ids, mask)
            lat[name][-1].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        n = 0
        for ids, mask in tp_batches:
            run(ids, mask)
            n += ids.shape[0]
        tp[name].append(n / (time.perf_counter() - t))
        if progress:
            progress(name)
    out = {}
    for name in names:
        pct = percentiles([x for samples in lat[name] for x in samples])
        # `throughput_b32` is measured at `params.batch_size` (32 by default); the key keeps its name for the metrics
        # files, stored results and MLflow history that read it, and every label shows the batch size itself.
        out[name] = {"p50_ms_b1": pct["p50"], "p95_ms_b1": pct["p95"], "p99_ms_b1": pct["p99"],
                     "throughput_b32": float(np.median(tp[name])),
                     "latency_samples": sum(len(samples) for samples in lat[name]), "rounds": len(lat[name]),
                     "latency_rounds_ms": lat[name]}
    return out


def peak_rss_mb(directory: Path, options: dict[str, Any], batch: tuple[np.ndarray, ...], threads: int) -> float:
    """Peak RSS of a fresh process that loads the variant and serves one batch (isolated per variant:
    `pipeline.evaluation.memory_probe`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rss-") as tmp:
        np.savez(Path(tmp) / "batch.npz", ids=batch[0], mask=batch[1])
        cmd = [sys.executable, "-m", memory_probe.__name__, str(directory), "--batch-file",
               str(Path(tmp) / "batch.npz"), "--threads", str(threads), "--options", json.dumps(options)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe failed for {directory}: {proc.stderr[-2000:]}")
        return float(proc.stdout.strip().splitlines()[-1])


def peak_rss_of_each(probes: dict[str, tuple[Path, dict[str, Any]]], batch: tuple[np.ndarray, ...],
                     threads: int) -> dict[str, float]:
    """`peak_rss_mb` of every (directory, options) in `probes`, by name. The probes run side by side, up to one per
    core: each is its own process, whose peak RSS does not depend on what else runs, and most of a probe is the
    single-threaded import of its runtime."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(len(probes), available_cpus()))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = {name: pool.submit(peak_rss_mb, d, options, batch, threads) for name, (d, options) in probes.items()}
        peaks = {name: future.result() for name, future in futures.items()}
    except BaseException:  # a failed probe, Ctrl-C, SIGTERM: the probes not started yet are not started
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return peaks
