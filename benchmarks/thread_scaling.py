"""Does the default run use the cores it is given? The work that dominates `make run`, timed at 1, 2, 4, ... threads
up to the CPUs this process may use: an epoch of training reviews through the finetune stage's own module, data
module and Trainer (its batch size, bucketing, training window and `train.precision` as resolved here, from the
finetuned weights), scoring the test reviews with each built variant as the evaluate stage does (its batch size),
and batch-1 latency timed by the benchmark stage's own `measure`.

    python -m benchmarks.thread_scaling [--threads 1,2] [--reviews 160] [--train-reviews 96] [--rounds 2]

Thread counts alternate inside each round (1, 2, ..., then back), so drift on a shared machine hits every count
alike; the median round counts. Per unit: the rate at each count, the speed-up over 1 thread and the parallel
efficiency (speed-up ÷ threads). Prints a table and writes `benchmarks/results/thread_scaling.json` with the CPU,
its ISA flags and the thread settings. Reads the outputs of a `make run` (`models/`, `data/tokenized`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline.core.params import BenchmarkParams, Params

ROOT = Path(__file__).resolve().parents[1]
def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... below `cpus`, then `cpus` itself."""
    counts, t = [], 1
    while t < cpus:
        counts.append(t)
        t *= 2
    return [*counts, cpus]


def train_rate(finetuned: Path, tokenized: Path, params: Params, threads: int) -> float:
    """Training samples/s of the finetune stage's own path (`benchmarks.seed_recipe.lightning_run`: its module, data
    module and Trainer under `params.train`'s precision, batch size, bucketing and training window) over one epoch
    of the reviews in `tokenized`, starting from the finetuned weights; the first step is not timed."""
    import dataclasses

    import torch

    from benchmarks.seed_recipe import StepClock, lightning_run
    from pipeline.data.tokens import window_shortener
    from pipeline.modeling import load_finetuned, pad_id

    torch.set_num_threads(threads)
    model, tokenizer, _ = load_finetuned(finetuned)
    data, train = params.data, dataclasses.replace(params.train, epochs=1, threads=threads)
    shorten = window_shortener(train.max_length, data.max_length, data.truncation, data.head_fraction,
                               tokenizer.cls_token_id, tokenizer.sep_token_id)
    clock = StepClock(warmup=1, device="cpu")
    lightning_run(model, tokenized, train, clock, pad_id(tokenizer), shorten)
    return clock.samples / clock.seconds


def score_rate(directory: Path, seqs: list[np.ndarray], batch_size: int, pad: int, threads: int) -> float:
    """Reviews/s scoring `seqs` with the variant in `directory` the way the evaluate stage does: its runner and
    number of concurrent callers (`runner_for_test_split`) at `threads` threads, the fp32 reference included."""
    from pipeline.evaluation.accuracy import runner_for_test_split
    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.record import VARIANT_FILE
    from pipeline.runtimes.registry import load_runner

    if (directory / VARIANT_FILE).is_file():
        runner, callers = runner_for_test_split(directory, threads)
    else:  # the finetuned checkpoint, which the evaluate stage scores with one call at a time
        runner, callers = load_runner(directory, threads), 1
    predict_logits(runner, seqs[:batch_size], batch_size, pad, callers=callers)  # warm-up
    t0 = time.perf_counter()
    predict_logits(runner, seqs, batch_size, pad, callers=callers)
    return len(seqs) / (time.perf_counter() - t0)


def latency_ms(directory: Path, seqs: list[np.ndarray], params: BenchmarkParams, pad: int, threads: int) -> float:
    """Batch-1 p50 (ms) of the variant in `directory`, timed by the benchmark stage's own `measure` under `params`."""
    from pipeline.evaluation.latency import latency_inputs, measure, throughput_batches
    from pipeline.runtimes.registry import load_runner

    runners = {"variant": load_runner(directory, threads)}
    lat = latency_inputs(seqs, params.seq_len, params.latency_reviews, pad)
    batches = throughput_batches(seqs, params.batch_size, params.throughput_batches, pad)
    return measure(runners, lat, batches, params)["variant"]["p50_ms_b1"]


def scaling_rows(rates: dict[str, dict[int, float]], higher_is_better: dict[str, bool]) -> list[dict[str, Any]]:
    """Per unit: the median rate at each thread count, the speed-up over the fewest threads, the efficiency."""
    rows = []
    for unit, by_threads in rates.items():
        counts = sorted(by_threads)
        base = by_threads[counts[0]]
        row: dict[str, Any] = {"unit": unit, "higher_is_better": higher_is_better[unit], "by_threads": {}}
        for t in counts:
            value = by_threads[t]
            speedup = value / base if higher_is_better[unit] else base / value
            row["by_threads"][str(t)] = {"value": value, "speedup": speedup, "efficiency": speedup * counts[0] / t}
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    counts = sorted({int(t) for r in rows for t in r["by_threads"]})
    head = "| unit | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in counts) + \
           f" | speed-up at {counts[-1]} | efficiency |"
    lines = [head, "|---|" + "---:|" * (len(counts) + 2)]
    for r in rows:
        last = r["by_threads"][str(counts[-1])]
        cells = [f"{r['by_threads'][str(t)]['value']:.1f}" for t in counts]
        cells += [f"{last['speedup']:.2f}x", f"{last['efficiency']:.0%}"]
        lines.append(f"| {r['unit']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    p.add_argument("--finetuned", type=Path, default=ROOT / "models" / "finetuned")
    p.add_argument("--variants-root", type=Path, default=ROOT / "models" / "variants")
    p.add_argument("--tokenized", type=Path, default=ROOT / "data" / "tokenized")
    p.add_argument("--threads", default=None, help="comma-separated counts (default 1, 2, 4, ... up to the CPUs)")
    p.add_argument("--reviews", type=int, default=160, help="test reviews scored per variant and count")
    p.add_argument("--train-reviews", type=int, default=96, help="training reviews per count (one epoch)")
    p.add_argument("--latency-calls", type=int, default=20, help="batch-1 calls per variant and count")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names (default: every variant built under --variants-root)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "thread_scaling.json")
    args = p.parse_args(argv)
    load_start = os.getloadavg()

    from benchmarks.provenance import provenance
    from pipeline.core.io import write_json
    from pipeline.core.machine import available_cpus, thread_tags
    from pipeline.core.params import load_params, resolve_auto
    from pipeline.data.tokens import read_tokenized
    from pipeline.modeling import saved_pad_id
    from pipeline.runtimes.catalog import VARIANTS
    from pipeline.runtimes.record import VARIANT_FILE, read_variant

    asked = load_params(args.params)
    auto = resolve_auto(asked)
    params, precision = auto.apply(asked), auto.precision
    cpus = available_cpus()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else thread_counts(cpus)
    pad = saved_pad_id(args.finetuned)
    test = read_tokenized(args.tokenized, "test")
    seqs = test["input_ids"].tolist()[: args.reviews]
    window = params.train.max_length or params.data.max_length
    bench = dataclasses.replace(params.benchmark, rounds=1, warmup=2, iterations=args.latency_calls,
                                latency_reviews=args.latency_calls, throughput_batches=1,
                                batch_size=min(params.benchmark.batch_size, len(seqs)))
    work = Path(tempfile.mkdtemp(prefix="thread-scaling-"))  # the training reviews, in the prepare stage's layout
    for split, rows in (("train", args.train_reviews), ("val", 8), ("test", 8)):
        read_tokenized(args.tokenized, split).head(rows).to_parquet(work / f"{split}.parquet")

    built = {"fp32-eager": args.finetuned}
    names = args.variants.split(",") if args.variants else [v.name for v in VARIANTS if v.file]
    for name in names:
        d = args.variants_root / name
        if (d / VARIANT_FILE).is_file() and read_variant(d).status == "ok":
            built[name] = d
    # unit -> (measure at a thread count, whether a higher value is better)
    units: dict[str, tuple[Callable[[int], float], bool]] = {
        f"train samples/s ({precision.value}, batch {params.train.batch_size}, {window} tokens)": (
            lambda t: train_rate(args.finetuned, work, params, t), True)}
    for name, d in built.items():
        units[f"{name} scoring reviews/s (batch {params.evaluate.batch_size})"] = (
            lambda t, d=d: score_rate(d, seqs, params.evaluate.batch_size, pad, t), True)
        units[f"{name} p50 ms (batch 1, {params.benchmark.seq_len} tokens)"] = (
            lambda t, d=d: latency_ms(d, seqs, bench, pad, t), False)

    settings = thread_tags()  # as the run starts (each measurement then sets its own count)
    samples: dict[str, dict[int, list[float]]] = {u: {t: [] for t in counts} for u in units}
    try:
        for r in range(args.rounds):
            order = counts if r % 2 == 0 else counts[::-1]
            for t in order:
                for unit, (run, _) in units.items():
                    samples[unit][t].append(run(t))
                    print(f"round {r + 1}, {t} threads, {unit}: {samples[unit][t][-1]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rates = {u: {t: statistics.median(v) for t, v in by.items()} for u, by in samples.items()}
    rows = scaling_rows(rates, {unit: higher for unit, (_, higher) in units.items()})
    result = {"rows": rows, "threads": counts, "cpus_available": cpus, "precision": precision.to_dict(),
              "reviews": len(seqs), "train_reviews": args.train_reviews, "rounds": args.rounds,
              "thread_settings": settings, **provenance("benchmarks.thread_scaling", argv, threads=counts[-1])}
    result["machine"]["loadavg_start"] = list(load_start)
    write_json(args.out, result)
    print(table(rows))
    print(f"wrote {args.out} ({json.dumps(result['machine']['cpu'])})")


if __name__ == "__main__":
    main()
