"""Latency, throughput and memory of every variant, measured the same way, alternating between variants.

Rerun alone on chosen variants with `python -m pipeline.bench --variants int8-static,fp32-onnx`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import BenchmarkParams
from pipeline.variants import VARIANT_FILE, Runner, load_runner, pad_batch, read_variant

log = logging.getLogger(__name__)

REFERENCE = "fp32-eager"
SPEEDUP_LEVEL = 0.9  # the speed-up interval's coverage (`speedup_interval`)
BF16_ROW = "fp32-eager-bf16"


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99 with linear interpolation (numpy's default), in ms."""
    if not samples_ms:
        raise ValueError("no latency samples")
    a = np.asarray(samples_ms, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99))}


def speedup_interval(reference_rounds: Sequence[Sequence[float]], rounds: Sequence[Sequence[float]],
                     level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
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


def alternating_schedule(names: Sequence[str], rounds: int) -> list[str]:
    """A B C A B C ...: every round visits every variant once, so drift hits all alike."""
    return [name for _ in range(rounds) for name in names]


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model, ISA flags that matter for INT8/bf16, thread settings and library versions."""
    flags: set[str] = set()
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"]
    versions = {}
    for mod in ("torch", "onnxruntime", "onnx", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "absent"
    return {"cpu": model, "logical_cpus": os.cpu_count(), "threads_used": threads,
            "isa": {f: f in flags for f in wanted}, "python": platform.python_version(), "versions": versions}


@dataclass
class Candidate:
    """A variant to measure: how to build its runner and where it lives."""

    name: str
    directory: Path
    options: dict[str, Any]
    status: str = "ok"
    reason: str = ""
    cls_readout: bool = False  # the variant's last layer computes the [CLS] position only (`pipeline.readout`)


def candidates(finetuned: Path, variant_dirs: dict[str, Path], include_bf16: bool) -> list[Candidate]:
    """FP32 eager first (the reference), the bf16-autocast row, then every variant (skipped ones kept)."""
    out = [Candidate(REFERENCE, finetuned, {})]
    if include_bf16:
        out.append(Candidate(BF16_ROW, finetuned, {"autocast_bf16": True}))
    for name, d in variant_dirs.items():
        info = read_variant(d)
        out.append(Candidate(name, d, {}, info.status, info.reason, bool(info.params.get("cls_readout", False))))
    return out


def latency_inputs(seqs: Sequence[np.ndarray], seq_len: int, count: int, pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """Batch-1 inputs of exactly `seq_len` tokens: real reviews truncated or padded to it."""
    out = []
    for s in seqs[:count]:
        ids, mask = pad_batch([s[:seq_len]], pad_id, seq_len)
        out.append((ids, mask))
    return out


def throughput_batches(seqs: Sequence[np.ndarray], batch: int, n_batches: int,
                       pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """Batches of real reviews in test-split order, each padded to its own longest review."""
    return [pad_batch(list(seqs[i * batch : (i + 1) * batch]), pad_id) for i in range(n_batches)
            if len(seqs[i * batch : (i + 1) * batch]) == batch]


def measure(runners: dict[str, Runner], lat_inputs: list[tuple[np.ndarray, ...]],
            tp_batches: list[tuple[np.ndarray, ...]], params: BenchmarkParams,
            progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Warm up each runner, then alternate rounds of batch-1 latency and batch-N throughput.

    Every round starts with `params.warmup` untimed calls as well: right after another variant ran, the first
    one or two calls take up to 2.5x the steady latency (evicted caches, idle threads), and with 10 timed calls
    per round they would be a fifth of the samples, inflating p95 and nudging p50.
    Each row keeps its latency samples by round (`latency_rounds_ms`) for `speedup_interval`."""
    names = list(runners)
    for name in names:
        for i in range(params.warmup):
            runners[name](*lat_inputs[i % len(lat_inputs)])
        runners[name](*tp_batches[0])
    lat: dict[str, list[list[float]]] = {n: [] for n in names}  # one list of samples per round
    tp: dict[str, list[float]] = {n: [] for n in names}
    per_round = max(1, params.iterations // params.rounds)
    for r, name in enumerate(alternating_schedule(names, params.rounds)):
        run = runners[name]
        lat[name].append([])
        for i in range(params.warmup):  # the first calls after another variant ran are cold (caches, threads)
            run(*lat_inputs[(r * per_round + i) % len(lat_inputs)])
        for i in range(per_round):
            ids, mask = lat_inputs[(r * per_round + i) % len(lat_inputs)]
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
        out[name] = {"p50_ms_b1": pct["p50"], "p95_ms_b1": pct["p95"], "p99_ms_b1": pct["p99"],
                     "throughput_b32": float(np.median(tp[name])),
                     "latency_samples": sum(len(samples) for samples in lat[name]), "latency_rounds_ms": lat[name]}
    return out


def peak_rss_mb(directory: Path, options: dict[str, Any], batch: tuple[np.ndarray, ...], threads: int) -> float:
    """Peak RSS of a fresh process that loads the variant and serves one batch (isolated per variant)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rss-") as tmp:
        np.savez(Path(tmp) / "batch.npz", ids=batch[0], mask=batch[1])
        cmd = [sys.executable, "-m", "pipeline.bench", "--rss-probe", str(directory), "--batch-file",
               str(Path(tmp) / "batch.npz"), "--threads", str(threads), "--options", json.dumps(options)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe failed for {directory}: {proc.stderr[-2000:]}")
        return float(proc.stdout.strip().splitlines()[-1])


def _rss_probe(directory: Path, batch_file: Path, threads: int, options: dict[str, Any]) -> None:
    data = np.load(batch_file)
    runner = load_runner(directory, threads, **options)
    runner(data["ids"], data["mask"])
    print(vm_hwm_mb())


def vm_hwm_mb() -> float:
    """This process's peak RSS (VmHWM) in MB; unlike ru_maxrss it starts afresh at exec, not at fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_benchmark(finetuned: Path, variant_dirs: dict[str, Path], tokenized: Path, params: BenchmarkParams,
                  accuracy: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Measure every candidate; skipped variants stay in the table with their reason."""
    from tqdm.auto import tqdm

    from pipeline.data import read_tokenized

    threads = params.threads or os.cpu_count() or 1
    import torch

    torch.set_num_threads(threads)
    seqs = read_tokenized(tokenized, "test")["input_ids"].tolist()
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(finetuned).pad_token_id or 0  # the model's own padding id
    lat_inputs = latency_inputs(seqs, params.seq_len, params.latency_reviews, pad)
    tp_batches = throughput_batches(seqs, params.batch_size, params.throughput_batches, pad)
    cands = candidates(finetuned, variant_dirs, params.bf16_row)
    runners: dict[str, Runner] = {}
    for c in cands:
        if c.status == "ok":
            runners[c.name] = load_runner(c.directory, threads, **c.options)
    total = params.rounds * len(runners)
    with tqdm(total=total, desc="benchmark", unit="run") as bar:
        timings = measure(runners, lat_inputs, tp_batches, params, progress=lambda _: bar.update(1))
    results: dict[str, Any] = {}
    ref = timings[REFERENCE]["p50_ms_b1"]
    ref_rounds = timings[REFERENCE]["latency_rounds_ms"]
    for c in cands:
        entry: dict[str, Any] = {"status": c.status, "reason": c.reason}
        if c.status == "ok":
            entry["cls_readout"] = c.cls_readout
            rounds = timings[c.name].pop("latency_rounds_ms")
            entry.update(timings[c.name])
            entry["speedup_p50_vs_fp32_eager"] = ref / entry["p50_ms_b1"]
            if c.name != REFERENCE:
                low, high = speedup_interval(ref_rounds, rounds, SPEEDUP_LEVEL)
                entry["speedup_p50_low"], entry["speedup_p50_high"] = low, high
            if params.memory:
                entry["peak_rss_mb"] = peak_rss_mb(c.directory, c.options, tp_batches[0], threads)
        acc = (accuracy or {}).get(c.name if c.name != BF16_ROW else REFERENCE, {})
        for key in ("accuracy", "size_mb", "agreement_with_fp32"):
            if key in acc and c.name != BF16_ROW:
                entry[key] = acc[key]
        results[c.name] = entry
    return {"variants": results, "machine": machine_info(threads),
            "settings": {"seq_len": params.seq_len, "batch_size": params.batch_size, "rounds": params.rounds,
                         "iterations": params.iterations, "warmup": params.warmup}}


def main(argv: list[str] | None = None) -> None:
    """Rerun the benchmark alone: `python -m pipeline.bench --variants int8-static,fp32-onnx`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variants-root", type=Path, default=Path("models/variants"))
    parser.add_argument("--finetuned", type=Path, default=Path("models/finetuned"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_cli.json"))
    parser.add_argument("--rss-probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe:
        _rss_probe(args.rss_probe, args.batch_file, args.threads, json.loads(args.options))
        return

    from pipeline.cli import setup_logging
    from pipeline.config import read_params, section
    from pipeline.io import write_json

    setup_logging()
    params = section(read_params(args.params), "benchmark", BenchmarkParams)
    wanted = [v for v in args.variants.split(",") if v]
    dirs = {d.name: d for d in sorted(args.variants_root.iterdir()) if (d / VARIANT_FILE).is_file()}
    unknown = [v for v in wanted if v not in dirs and v not in (REFERENCE, BF16_ROW)]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; available: {sorted(dirs)}")
    if wanted:
        dirs = {k: v for k, v in dirs.items() if k in wanted}
    result = run_benchmark(args.finetuned, dirs, args.tokenized, params)
    write_json(args.out, result)
    print(markdown_table(result["variants"]))


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
                    "(`pipeline.bench.speedup_interval`).")
    return "\n".join(rows)


def speedup_interval_text(entry: dict[str, Any]) -> str:
    """The speed-up interval as the table and the chart print it after the ratio; empty for rows without one."""
    if "speedup_p50_low" not in entry:
        return ""
    return f" ({entry['speedup_p50_low']:.2f}-{entry['speedup_p50_high']:.2f})"


if __name__ == "__main__":
    main()
