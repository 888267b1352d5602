"""Does the default run use the cores it is given? The work that dominates `make run`, timed at 1, 2, 4, ... threads
up to the CPUs this process may use: training steps of the finetuned model as the finetune stage runs them (its
batch size, training window and `train.precision` as resolved here), and scoring the test reviews with each built
variant as the evaluate stage does (its batch size), plus batch-1 latency as the benchmark stage times it.

    python -m benchmarks.thread_scaling [--threads 1,2] [--reviews 160] [--train-steps 6] [--rounds 2]

Thread counts alternate inside each round (1, 2, ..., then back), so drift on a shared machine hits every count
alike; the median round counts. Per unit: the rate at each count, the speed-up over 1 thread and the parallel
efficiency (speed-up ÷ threads). Prints a table and writes `benchmarks/results/thread_scaling.json` with the CPU,
its ISA flags and the thread settings. Reads the outputs of a `make run` (`models/`, `data/tokenized`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: The variants the default profile builds, scored and timed where they are built here.
VARIANTS = ("fp32-onnx", "int8-dynamic", "int8-openvino")


def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... below `cpus`, then `cpus` itself."""
    counts, t = [], 1
    while t < cpus:
        counts.append(t)
        t *= 2
    return [*counts, cpus]


def train_rate(finetuned: Path, seqs: list[np.ndarray], labels: np.ndarray, batch_size: int, window: int,
               precision: str, steps: int, pad: int, threads: int) -> float:
    """Training samples/s of the finetuned model: AdamW steps on `batch_size` reviews cut to `window` tokens, under
    bf16 autocast where `precision` is bf16-mixed (the finetune stage's setting), after one untimed step."""
    import torch

    from pipeline.modeling import load_finetuned
    from pipeline.runtimes.base import pad_batch

    torch.set_num_threads(threads)
    model, _, _ = load_finetuned(finetuned)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step(i: int) -> None:
        start = (i * batch_size) % max(1, len(seqs) - batch_size)
        ids, mask = pad_batch([s[:window] for s in seqs[start : start + batch_size]], pad)
        with autocast:
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        labels=torch.tensor(labels[start : start + batch_size], dtype=torch.long))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    return steps * batch_size / (time.perf_counter() - t0)


def score_rate(directory: Path, seqs: list[np.ndarray], batch_size: int, pad: int, threads: int) -> float:
    """Reviews/s scoring `seqs` with the variant in `directory` the way the evaluate stage does."""
    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.registry import load_runner

    runner = load_runner(directory, threads)
    predict_logits(runner, seqs[:batch_size], batch_size, pad)  # warm-up
    t0 = time.perf_counter()
    predict_logits(runner, seqs, batch_size, pad)
    return len(seqs) / (time.perf_counter() - t0)


def latency_ms(directory: Path, seqs: list[np.ndarray], seq_len: int, pad: int, threads: int, calls: int) -> float:
    """Median batch-1 latency (ms) at `seq_len` tokens, as the benchmark stage times it."""
    from pipeline.evaluation.latency import latency_inputs
    from pipeline.runtimes.registry import load_runner

    runner = load_runner(directory, threads)
    inputs = latency_inputs(seqs, seq_len, calls, pad)
    runner(*inputs[0])
    samples = []
    for ids, mask in inputs:
        t0 = time.perf_counter()
        runner(ids, mask)
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(samples))


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
    p.add_argument("--train-steps", type=int, default=6, help="timed training steps per count")
    p.add_argument("--latency-calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "thread_scaling.json")
    args = p.parse_args(argv)

    from pipeline.core.io import write_json
    from pipeline.core.machine import machine_info, thread_tags
    from pipeline.core.params import load_params, resolve_auto
    from pipeline.data.tokens import read_tokenized
    from pipeline.modeling import saved_pad_id
    from pipeline.runtimes.record import VARIANT_FILE, read_variant

    params = load_params(args.params)
    precision = resolve_auto(params).precision
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    counts = [int(t) for t in args.threads.split(",")] if args.threads else thread_counts(cpus)
    pad = saved_pad_id(args.finetuned)
    test = read_tokenized(args.tokenized, "test")
    seqs = test["input_ids"].tolist()[: args.reviews]
    train = read_tokenized(args.tokenized, "train")
    train_seqs, train_labels = train["input_ids"].tolist(), train["label"].to_numpy()
    window = params.train.max_length or params.data.max_length

    built = {"fp32-eager": args.finetuned}
    for name in VARIANTS:
        d = args.variants_root / name
        if (d / VARIANT_FILE).is_file() and read_variant(d).status == "ok":
            built[name] = d
    # unit -> (measure at a thread count, whether a higher value is better)
    units: dict[str, tuple[Callable[[int], float], bool]] = {
        f"train samples/s ({precision.value}, batch {params.train.batch_size}, {window} tokens)": (
            lambda t: train_rate(args.finetuned, train_seqs, train_labels, params.train.batch_size, window,
                                 precision.value, args.train_steps, pad, t), True)}
    for name, d in built.items():
        units[f"{name} scoring reviews/s (batch {params.evaluate.batch_size})"] = (
            lambda t, d=d: score_rate(d, seqs, params.evaluate.batch_size, pad, t), True)
        units[f"{name} p50 ms (batch 1, {params.benchmark.seq_len} tokens)"] = (
            lambda t, d=d: latency_ms(d, seqs, params.benchmark.seq_len, pad, t, args.latency_calls), False)

    settings = thread_tags()  # as the run starts (each measurement then sets its own count)
    samples: dict[str, dict[int, list[float]]] = {u: {t: [] for t in counts} for u in units}
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]
        for t in order:
            for unit, (run, _) in units.items():
                samples[unit][t].append(run(t))
                print(f"round {r + 1}, {t} threads, {unit}: {samples[unit][t][-1]:.2f}", flush=True)
    rates = {u: {t: statistics.median(v) for t, v in by.items()} for u, by in samples.items()}
    rows = scaling_rows(rates, {unit: higher for unit, (_, higher) in units.items()})
    result = {"rows": rows, "threads": counts, "cpus_available": cpus, "precision": precision.to_dict(),
              "reviews": len(seqs), "train_steps": args.train_steps, "rounds": args.rounds,
              "machine": {**machine_info(counts[-1]), "loadavg_start": list(os.getloadavg())},
              "thread_settings": settings, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_json(args.out, result)
    print(table(rows))
    print(f"wrote {args.out} ({json.dumps(result['machine']['cpu'])})")


if __name__ == "__main__":
    main()
