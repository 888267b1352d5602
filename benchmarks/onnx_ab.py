"""A/B latency of ONNX files (onnxruntime) and OpenVINO IR files (`.xml`) in one process, alternating A B A B ...

The pipeline benchmark's ratios hang on a PyTorch FP32 reference whose latency drifts between runs on a shared
machine; two graphs that differ by a few per cent (e.g. with and without `export.cls_readout`) are compared
more cleanly here. Each file runs as the pipeline runs it: an onnxruntime session as `ort_session` sets it up,
an IR compiled as `OpenVinoRunner` compiles it. Prints p10/p50/mean per file and writes
`benchmarks/results/onnx_ab.json`, with the CPU and its ISA flags.

`--op-profile N` (ONNX files) then runs each file N more times in a session of its own with onnxruntime's profiler
on (after the timing, so it does not disturb it) and prints where a run's time goes by operator type, after
onnxruntime's graph fusions: kernel microseconds and kernels per run, per file side by side.

    python -m benchmarks.onnx_ab OLD/model.onnx models/variants/int8-dynamic/model.onnx [--rounds 30]
    python -m benchmarks.onnx_ab models/variants/int8-{dynamic,static}/model.onnx --rounds 5 --op-profile 50
    python -m benchmarks.onnx_ab models/variants/int8-{openvino,qat-openvino}/model.xml
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.io import write_json
from pipeline.runtimes.ort import ort_session, session_options

ROOT = Path(__file__).resolve().parents[1]


#: Untimed runs before the profiled ones (their events are left out of the per-run figures).
PROFILE_WARMUP = 10


def op_profile(path: Path, feed: dict[str, np.ndarray], threads: int, runs: int) -> dict[str, Any]:
    """Kernel time and kernel count per run by operator type, from onnxruntime's profiler over `runs` runs of `feed`
    (after `PROFILE_WARMUP` runs), in the optimised graph the session really executes."""
    import onnxruntime as ort

    opts = session_options(threads, "all")
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory(prefix="ort-profile-") as tmp:
        opts.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        for _ in range(PROFILE_WARMUP + runs):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    run_starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    if len(run_starts) < PROFILE_WARMUP + runs:
        raise RuntimeError(f"onnxruntime's profile of {path} holds {len(run_starts)} runs, expected "
                           f"{PROFILE_WARMUP + runs}")
    first = run_starts[PROFILE_WARMUP]
    runs_us = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"
               and e["ts"] >= first]
    micros: dict[str, float] = defaultdict(float)
    kernels: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            op = e.get("args", {}).get("op_name", "?")
            micros[op] += e["dur"]
            kernels[op] += 1
    return {"runs": runs, "run_us_median": float(np.median(runs_us)),
            "ops": {op: {"us_per_run": micros[op] / runs, "kernels_per_run": kernels[op] / runs}
                    for op in sorted(micros, key=micros.get, reverse=True)}}


def print_op_profiles(profiles: dict[str, dict[str, Any]]) -> None:
    """One row per operator type (the union over files), microseconds and kernels per run for each file."""
    names = list(profiles)
    ops = sorted({op for p in profiles.values() for op in p["ops"]},
                 key=lambda op: -max(p["ops"].get(op, {}).get("us_per_run", 0.0) for p in profiles.values()))
    print("\n| op type | " + " | ".join(f"{Path(n).parent.name or n} µs/run (kernels)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for op in ops:
        cells = []
        for n in names:
            row = profiles[n]["ops"].get(op)
            cells.append(f"{row['us_per_run']:.0f} ({row['kernels_per_run']:.0f})" if row else "-")
        print(f"| {op} | " + " | ".join(cells) + " |")
    print("| **whole run (median)** | " + " | ".join(f"{profiles[n]['run_us_median']:.0f}" for n in names) + " |")


def batch1_call(path: Path, threads: int) -> Callable[[dict[str, np.ndarray]], Any]:
    """A call that runs `path` on a feed: an OpenVINO IR (`.xml`) compiled as `OpenVinoRunner` compiles it, else an
    onnxruntime session as the pipeline sets one up."""
    if path.suffix == ".xml":
        from pipeline.runtimes.openvino import compiled_model

        compiled = compiled_model(path, threads)
        request, names = compiled.create_infer_request(), {i.get_any_name() for i in compiled.inputs}
        return lambda feed: request.infer({k: v for k, v in feed.items() if k in names})  # as `OpenVinoRunner` feeds
    session = ort_session(path, threads)
    return lambda feed: session.run(None, feed)


def main(argv: list[str] | None = None) -> None:
    """Time each file at batch 1 on the same input, in alternating blocks (sessions set up as the benchmark's)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=20, help="runs of one file before switching")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/onnx_ab.json")
    parser.add_argument("--op-profile", type=int, default=0, metavar="N",
                        help="then profile N runs of each file by operator type (onnxruntime's profiler)")
    args = parser.parse_args(argv)

    if args.op_profile and any(m.suffix == ".xml" for m in args.models):
        parser.error("--op-profile reads onnxruntime's profiler: ONNX files only")
    sessions = [batch1_call(m, args.threads) for m in args.models]
    ids = np.random.default_rng(0).integers(1000, 2000, (1, args.seq_len)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for s in sessions:
        for _ in range(10):
            s(feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(args.rounds):
        for i, s in enumerate(sessions):
            for _ in range(args.block):
                t0 = time.perf_counter()
                s(feed)
                times[i].append(1000 * (time.perf_counter() - t0))
    rows = {str(m): {"p10_ms": float(np.percentile(t, 10)), "p50_ms": float(np.median(t)),
                     "mean_ms": float(np.mean(t)), "runs": len(t)} for m, t in zip(args.models, times, strict=True)}
    profiles = ({str(m): op_profile(m, feed, args.threads, args.op_profile) for m in args.models}
                if args.op_profile else {})
    from benchmarks.provenance import provenance

    write_json(args.out, {**provenance("benchmarks.onnx_ab", argv, threads=args.threads), "seq_len": args.seq_len,
                          "threads": args.threads,
                          "models": rows,
                          **({"op_profiles": profiles} if profiles else {})})
    print("| model | p10 ms | p50 ms | mean ms |\n|---|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['p10_ms']:.2f} | {r['p50_ms']:.2f} | {r['mean_ms']:.2f} |")
    if profiles:
        print_op_profiles(profiles)


if __name__ == "__main__":
    main()
