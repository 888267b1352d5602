"""What an interruption costs: the finetune stage run whole, then the same stage stopped at about `--at` of its
steps (SIGKILL by default, as a preempted machine would; `--signal TERM` for a graceful stop) and run again, which
resumes from the newest checkpoint (`pipeline.training.resume`).

Every run is the real stage process (`python -m stages.finetune`) on this checkout's `params.yaml` (overridden by
`-S key=value`) and `data/tokenized` (run `dvc repro prepare` first), writing to a scratch directory, never to the
stage's DVC outputs. Prints a table and writes `benchmarks/results/interrupted_finetune.json`: wall times, the
interrupted run's last checkpoint, the resumed run's step count and test accuracy against the whole run's, and the
machine (CPU model, ISA flags).

    python -m benchmarks.interrupted_finetune --at 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance
from pipeline.core.io import write_json
from pipeline.core.params import load_params, set_value

ROOT = Path(__file__).resolve().parents[1]


def run_params(work: Path, overrides: list[str]) -> int:
    """This checkout's params.yaml copied into `work`, with `overrides` (`key=value`) and the run's own checkpoint
    directory and tracking store set through the config loader's writer (YAML 1.2, comments kept), then read back
    by the loader (a bad override fails here, before any work). Returns the checkpoint interval in steps."""
    params = work / "params.yaml"
    shutil.copy2(ROOT / "params.yaml", params)
    for override in [*overrides, f"train.checkpoint_dir={work / 'checkpoints'}",
                     f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}"]:
        key, _, value = override.partition("=")
        set_value(params, key, value)
    return load_params(params).train.checkpoint_every_n_steps


def _stage(work: Path, tokenized: Path) -> list[str]:
    return [sys.executable, "-m", "stages.finetune", "--params", str(work / "params.yaml"), "--tokenized",
            str(tokenized), "--model-dir", str(work / "model"), "--metrics", str(work / "metrics.json"),
            "--plots", str(work / "plots"), "--reports", str(work / "reports")]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PIPELINE_RUN_ID": "interrupted-finetune"}


def _run(work: Path, tokenized: Path, log: str, stop_at: int | None = None,
         sig: int = signal.SIGKILL) -> dict[str, Any]:
    """One stage process; with `stop_at`, `sig` is sent once the periodic checkpoint at that step exists."""
    started = time.perf_counter()
    with (work / log).open("w") as out:
        proc = subprocess.Popen(_stage(work, tokenized), cwd=work, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        stopped_at = None
        while proc.poll() is None:
            if stop_at is not None and stopped_at is None:
                done = [int(p.stem.split("=")[-1]) for p in (work / "checkpoints").rglob("periodic/step=*.ckpt")]
                if done and max(done) >= stop_at:
                    proc.send_signal(sig)
                    stopped_at = max(done)
            time.sleep(0.05)
    seconds = time.perf_counter() - started
    record: dict[str, Any] = {"wall_s": round(seconds, 1), "returncode": proc.returncode, "log": log}
    if stopped_at is not None:
        record["signal_after_checkpoint_step"] = stopped_at
    if proc.returncode == 0:
        m = json.loads((work / "metrics.json").read_text())
        record.update({k: m[k] for k in ("train_steps", "test_accuracy", "resumed", "resumed_from_step",
                                          "resume_reason", "train_seconds")})
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=float, default=0.5, help="fraction of the steps after which to stop")
    parser.add_argument("--signal", choices=["KILL", "TERM", "INT"], default="KILL")
    parser.add_argument("-S", dest="overrides", action="append", default=[], help="params override key=value")
    parser.add_argument("--tokenized", type=Path, default=ROOT / "data" / "tokenized")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "interrupted_finetune.json")
    args = parser.parse_args(argv)
    if not (args.tokenized / "train.parquet").is_file():
        raise SystemExit(f"{args.tokenized} has no tokenized splits: run `.venv/bin/dvc repro prepare` first")

    results: dict[str, Any] = {**provenance("benchmarks.interrupted_finetune", argv, threads=0),
                               "overrides": args.overrides}
    with tempfile.TemporaryDirectory(prefix="interrupted-") as tmp:
        runs = {}
        for name in ("whole", "interrupted"):
            work = Path(tmp) / name
            work.mkdir()
            every = run_params(work, args.overrides)
            runs[name] = work
        whole = _run(runs["whole"], args.tokenized, "whole.log")
        steps = whole.get("train_steps")
        if not steps:
            raise SystemExit(f"the whole run failed (exit {whole['returncode']}): see {runs['whole'] / 'whole.log'}")
        stop_at = max(every, int(steps * args.at) // every * every)
        first = _run(runs["interrupted"], args.tokenized, "first.log", stop_at, getattr(signal, f"SIG{args.signal}"))
        second = _run(runs["interrupted"], args.tokenized, "second.log")
        results.update({"whole": whole, "first_attempt": first, "resumed_attempt": second,
                        "checkpoint_every_n_steps": every})
    total = first["wall_s"] + second["wall_s"]
    results["summary"] = {"interrupted_total_wall_s": round(total, 1),
                          "overhead_vs_whole_s": round(total - whole["wall_s"], 1),
                          "same_step_count": second.get("train_steps") == steps,
                          "test_accuracy_delta_pt": round(100 * (second.get("test_accuracy", float("nan"))
                                                                 - whole["test_accuracy"]), 2)}
    write_json(args.out, results)
    print(f"{'run':<22}{'wall s':>8}{'steps':>7}{'from step':>10}{'test acc':>10}")
    for name, r in (("whole", whole), ("interrupted (1st)", first), ("resumed (2nd)", second)):
        print(f"{name:<22}{r['wall_s']:>8}{r.get('train_steps', '-')!s:>7}{r.get('resumed_from_step', '-')!s:>10}"
              f"{r.get('test_accuracy', float('nan')):>10.4f}")
    s = results["summary"]
    print(f"interrupted + resumed {s['interrupted_total_wall_s']} s vs whole {whole['wall_s']} s "
          f"(overhead {s['overhead_vs_whole_s']} s); same steps: {s['same_step_count']}; "
          f"test accuracy {s['test_accuracy_delta_pt']:+.2f} pt; wrote {args.out}")


if __name__ == "__main__":
    main()
