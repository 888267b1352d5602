"""The pipeline's own variants side by side with what a user would serve this model with instead, in one run.

Same finetuned teacher (and, where the distill stage built it, the same student), same test reviews, same
tokenization, same threads: PyTorch eager FP32 (the reference), `torch.compile` FP32 (and under bf16 autocast where
the CPU has native bf16), torchao INT8 dynamic (compiled), OpenVINO FP32 and OpenVINO INT8 (NNCF post-training
quantization on the pipeline's calibration reviews), and the pipeline's own variants (onnxruntime ones and
int8-openvino, as `load_runner` runs them; `benchmarks.peer_runtimes` builds them all). Per row: test accuracy (and
agreement with the same model's FP32 eager labels), p50/p95 at batch 1 and `benchmark.seq_len` tokens, reviews/s at
`benchmark.batch_size`, peak RSS (a fresh process per row, which builds the row and answers one batch), build time
(to the first answer). Timings use the benchmark stage's machinery (`pipeline.evaluation.latency.measure`: warm-up,
alternating rounds, a bootstrap 90 % interval of each p50 speed-up over FP32 eager by whole rounds).

It then says, for batch 1 and for `benchmark.batch_size`, whether the fastest peer within
`targets.max_accuracy_loss_pt` of FP32 beats the fastest of the pipeline's variants within it (by how much, with the
paired interval), and how much of the CPU's measured INT8 GEMM peak (`benchmarks/results/int8_gemm_ceiling.json`)
the fastest variant uses at that batch size. `--ort-tuning` adds rows of the pipeline's INT8 variants under other
onnxruntime settings.
Prints a table; writes `benchmarks/results/peers.json` and `peers.png` beside it.

    python -m benchmarks.peers [--models teacher,student --rounds 8 --iterations 160 --throughput-batches 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peer_report import REFERENCE_ROW, ceiling_fraction, chart, table, verdicts
from benchmarks.peer_rows import accuracy_of, build_row, model_dirs, read_inputs, row_specs
from benchmarks.peer_runtimes import PeerRuntime, PeerUnavailable, package_version
from benchmarks.provenance import command_line
from pipeline.core.io import read_json, write_json
from pipeline.core.machine import machine_info, resolved_threads
from pipeline.core.params import Params, load_params
from pipeline.evaluation.latency import measure, speedup
from pipeline.evaluation.memory_probe import vm_hwm_mb

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def rss_probe(args: argparse.Namespace) -> None:
    """`--rss-probe ROW`: build one row in this fresh process, answer one throughput batch, print VmHWM (MB)."""
    params = _params(args)
    inputs = read_inputs(args.finetuned, args.tokenized, params, None)
    dirs, _ = model_dirs(args.finetuned, args.student, ["teacher", "student"])
    spec, options = next((s, o) for s, o in row_specs(["teacher", "student"], True) if s.name == args.rss_probe)
    runtime = build_row(spec, options, dirs[spec.model], args.variants_root, args.threads, inputs,
                        args.compile_backend)
    runtime(*inputs.tp_batches[0])
    print(vm_hwm_mb())


def peak_rss(name: str, args: argparse.Namespace) -> float:
    """Peak RSS of a fresh process that builds row `name` and answers one batch."""
    cmd = [sys.executable, "-m", "benchmarks.peers", "--rss-probe", name, "--params", str(args.params),
           "--finetuned", str(args.finetuned), "--student", str(args.student), "--variants-root",
           str(args.variants_root), "--tokenized", str(args.tokenized), "--threads", str(args.threads),
           "--compile-backend", args.compile_backend, *_overrides(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed for {name}: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def add_memory(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """`peak_rss_mb` of every measured row, each from a fresh process (`peak_rss`); a failed probe keeps its error."""
    for row in rows:
        if row["status"] == "ok":
            log.info("peak RSS of %s", row["name"])
            try:
                row["peak_rss_mb"] = peak_rss(row["name"], args)
            except RuntimeError as exc:
                row["peak_rss_mb"], row["peak_rss_error"] = None, str(exc)[-500:]


def _overrides(args: argparse.Namespace) -> list[str]:
    out = []
    for key in ("rounds", "iterations", "throughput_batches"):
        if getattr(args, key) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


def _params(args: argparse.Namespace) -> Params:
    params = load_params(args.params)
    b = params.benchmark
    changes = {k: getattr(args, k) for k in ("rounds", "iterations", "throughput_batches")
               if getattr(args, k) is not None}
    return dataclasses.replace(params, benchmark=dataclasses.replace(b, **changes))


def add_timings(rows: list[dict[str, Any]], timings: dict[str, dict[str, Any]]) -> None:
    """Each timed row's latency, throughput and speed-up over the reference row (with its interval), in place;
    its latency rounds under `_rounds` for the verdicts' paired intervals, removed before the rows are written."""
    ref = timings[REFERENCE_ROW]
    for row in rows:
        if row["name"] not in timings:
            continue
        t = timings[row["name"]]
        row["_rounds"] = t["latency_rounds_ms"]
        gain = speedup(ref, t)
        row.update({"p50_ms_b1": t["p50_ms_b1"], "p95_ms_b1": t["p95_ms_b1"], "p99_ms_b1": t["p99_ms_b1"],
                    "reviews_per_s_b32": t["throughput_b32"], "latency_samples": t["latency_samples"],
                    "speedup_p50": gain.p50})
        if row["name"] != REFERENCE_ROW:
            row["speedup_p50_low"], row["speedup_p50_high"] = gain.low, gain.high


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, score and time every row; returns the JSON document."""
    import torch

    params = _params(args)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    wanted = [m for m in args.models.split(",") if m]
    dirs, missing = model_dirs(args.finetuned, args.student, wanted)
    if "teacher" not in dirs:
        raise SystemExit(f"the teacher is needed as the reference: {missing.get('teacher')}")
    inputs = read_inputs(args.finetuned, args.tokenized, params, args.reviews)
    rows: list[dict[str, Any]] = []
    runtimes: dict[str, PeerRuntime] = {}
    reference_labels: dict[str, np.ndarray] = {}
    for spec, options in row_specs(wanted, args.ort_tuning):
        row: dict[str, Any] = {"name": spec.name, "runtime": spec.runtime, "model": spec.model,
                               "precision": spec.precision, "ours": spec.ours, "variant": spec.variant,
                               "status": "ok", "reason": ""}
        rows.append(row)
        if spec.model in missing:
            row.update(status="skipped", reason=missing[spec.model])
            continue
        if args.rows and not any(part in spec.name for part in args.rows.split(",")) and spec.name != REFERENCE_ROW \
                and not spec.name.endswith("pytorch-eager/fp32"):
            row.update(status="skipped", reason="not asked for (--rows)")
            continue
        log.info("building %s", spec.name)
        try:
            runtime = build_row(spec, options, dirs[spec.model], args.variants_root, args.threads, inputs,
                                args.compile_backend)
        except PeerUnavailable as exc:
            row.update(status="skipped", reason=str(exc))
            continue
        except Exception as exc:  # a peer that fails to build here is a finding: kept in the table with its error
            log.exception("%s failed to build", spec.name)
            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            continue
        log.info("scoring %s (built in %.1f s)", spec.name, runtime.build_s)
        acc, pred = accuracy_of(runtime, inputs, params.benchmark.batch_size)
        if spec.runtime == "pytorch-eager":
            reference_labels[spec.model] = pred
        row.update(runtime.describe())
        row["accuracy"] = acc
        row["agreement_with_fp32"] = float((pred == reference_labels[spec.model]).mean())
        runtimes[spec.name] = runtime
    log.info("timing %d rows, %d rounds", len(runtimes), params.benchmark.rounds)
    t0 = time.perf_counter()
    timings = measure(runtimes, inputs.lat_inputs, inputs.tp_batches, params.benchmark,  # type: ignore[arg-type]
                      progress=lambda name: log.info("round done: %s", name))
    measure_s = time.perf_counter() - t0
    load_end = os.getloadavg()
    add_timings(rows, timings)
    del runtimes  # free every model before the memory probes start their own processes
    if not args.no_memory:
        add_memory(rows, args)
    result_verdicts = verdicts(rows, params.targets)
    scored_ours = [r for r in rows if r["ours"] and r["status"] == "ok"]
    fastest = max(scored_ours, key=lambda r: r["reviews_per_s_b32"]) if scored_ours else None
    ceiling = None
    if fastest is not None:
        config = json.loads((dirs[fastest["model"]] / "config.json").read_text())
        ceiling = ceiling_fraction(fastest, config, inputs.tp_batches, args.ceiling)
    for row in rows:
        row.pop("_rounds", None)
    b = params.benchmark
    return {
        "command": command_line("benchmarks.peers", args.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": {**machine_info(args.threads), "loadavg_start": list(load_start), "loadavg_end": list(load_end),
                    "versions_peers": {m: package_version(m) for m in ("openvino", "nncf", "torchao")}},
        "settings": {"threads": args.threads, "seq_len": b.seq_len, "batch_size": b.batch_size, "rounds": b.rounds,
                     "iterations": b.iterations, "warmup": b.warmup, "throughput_batches": b.throughput_batches,
                     "latency_reviews": b.latency_reviews, "test_reviews": len(inputs.test_seqs),
                     "calibration_reviews": sum(len(x[0]) for x in inputs.calibration),
                     "compile_backend": args.compile_backend, "measure_s": measure_s,
                     "max_accuracy_loss_pt": params.targets.max_accuracy_loss_pt},
        "rows": rows, "verdicts": result_verdicts, "int8_ceiling": ceiling,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--finetuned", type=Path, default=Path("models/finetuned"))
    parser.add_argument("--student", type=Path, default=Path("models/distilled"))
    parser.add_argument("--variants-root", type=Path, default=Path("models/variants"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--models", default="teacher,student", help="teacher, student or both (a missing student "
                                                                     "is kept in the table as skipped)")
    parser.add_argument("--rows", default="", help="comma-separated parts of row names to build (FP32 eager "
                                                   "always); default: all")
    parser.add_argument("--threads", type=int, default=None, help="default: benchmark.threads, else all CPUs")
    parser.add_argument("--rounds", type=int, default=None, help="default: benchmark.rounds")
    parser.add_argument("--iterations", type=int, default=None, help="default: benchmark.iterations")
    parser.add_argument("--throughput-batches", type=int, default=None, help="default: benchmark.throughput_batches")
    parser.add_argument("--reviews", type=int, default=None, help="test reviews for accuracy (default: all)")
    parser.add_argument("--ort-tuning", action="store_true", help="add the pipeline's INT8 variants under other "
                                                                  "onnxruntime settings (`ORT_TUNING`)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-row peak RSS processes (add them "
                                                                 "later with --memory-only)")
    parser.add_argument("--memory-only", action="store_true", help="only add peak RSS to the rows of an existing "
                                                                   "--out file (same models and settings)")
    parser.add_argument("--ceiling", type=Path, default=ROOT / "benchmarks" / "results" / "int8_gemm_ceiling.json")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peers.json")
    parser.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)  # tests: aot_eager
    parser.add_argument("--rss-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("params", "finetuned", "student", "variants_root", "tokenized"):  # the probes run in ROOT
        setattr(args, name, getattr(args, name).resolve())
    if args.threads is None:
        args.threads = resolved_threads(load_params(args.params).benchmark.threads)  # as the benchmark stage
    if args.rss_probe:
        rss_probe(args)
        return None
    from pipeline.core.stage import setup_logging

    setup_logging()
    if args.memory_only:
        result = read_json(args.out)
        add_memory(result["rows"], args)
        result["command"] += " && " + command_line("benchmarks.peers", args.argv)
    else:
        result = run(args)
    write_json(args.out, result)
    title = (f"{result['machine']['cpu']}, {args.threads} threads, {result['date_utc']} UTC, load "
             f"{result['machine']['loadavg_start'][0]:.1f}-{result['machine']['loadavg_end'][0]:.1f}; green: pipeline")
    batch_size = result["settings"]["batch_size"]
    chart(result["rows"], args.out.with_suffix(".png"), title, batch_size)
    print(f"\n{title}\n" + table(result["rows"], batch_size))
    for v in result["verdicts"]:
        extra = f" (90 % interval {v['interval'][0]:.2f}-{v['interval'][1]:.2f})" if "interval" in v else ""
        print(f"{v['metric']}: best ours {v['best_ours']} {v['best_ours_value']:.2f}, best peer {v['best_peer']} "
              f"{v['best_peer_value']:.2f}: ours at {v['ours_speed_vs_peer']:.2f}x the peer's speed{extra} -> "
              f"{v['winner']} wins")
    if result["int8_ceiling"] and "skipped" in result["int8_ceiling"]:
        print(f"INT8 ceiling: not stated: {result['int8_ceiling']['skipped']}")
    elif result["int8_ceiling"]:
        c = result["int8_ceiling"]
        print(f"INT8 ceiling: {c['row']} at batch {batch_size} does {c['achieved_gflops']:.1f} GFLOP/s of weight "
              f"products, {100 * c['fraction_of_peak']:.1f} % of the measured INT8 GEMM peak "
              f"{c['peak_int8_gflops']:.1f} GFLOP/s ({c['peak_product']})")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
