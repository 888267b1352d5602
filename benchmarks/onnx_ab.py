"""A/B latency of ONNX files in one process: onnxruntime alone, alternating A B A B ...

The pipeline benchmark's ratios hang on a PyTorch FP32 reference that moves 38-44 ms between runs on this
2-vCPU machine; two graphs that differ by ~10 % (e.g. with and without `export.cls_readout`) are compared
more cleanly here. Prints p10/p50/mean per file and writes `benchmarks/results/onnx_ab.json`.

    python -m benchmarks.onnx_ab OLD/model.onnx models/variants/int8-dynamic/model.onnx [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from pipeline.core.io import write_json
from pipeline.runtimes.ort import ort_session

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    """Time each file at batch 1 on the same input, in alternating blocks (sessions set up as the benchmark's)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=20, help="runs of one file before switching")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/onnx_ab.json")
    args = parser.parse_args(argv)

    sessions = [ort_session(m, args.threads) for m in args.models]
    ids = np.random.default_rng(0).integers(1000, 2000, (1, args.seq_len)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for s in sessions:
        for _ in range(10):
            s.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(args.rounds):
        for i, s in enumerate(sessions):
            for _ in range(args.block):
                t0 = time.perf_counter()
                s.run(None, feed)
                times[i].append(1000 * (time.perf_counter() - t0))
    rows = {str(m): {"p10_ms": float(np.percentile(t, 10)), "p50_ms": float(np.median(t)),
                     "mean_ms": float(np.mean(t)), "runs": len(t)} for m, t in zip(args.models, times, strict=True)}
    write_json(args.out, {"seq_len": args.seq_len, "threads": args.threads, "models": rows})
    print("| model | p10 ms | p50 ms | mean ms |\n|---|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['p10_ms']:.2f} | {r['p50_ms']:.2f} | {r['mean_ms']:.2f} |")


if __name__ == "__main__":
    main()
