"""Many pipeline runs logging to one MLflow tracking store at once: what a team's store takes.

    python -m benchmarks.tracking_load --tracking-uri sqlite:///tmp/load.db,http://127.0.0.1:5000 --clients 1,4,16

Each client is a process of its own, as each stage of each teammate's `dvc repro` is, with an `MlflowClient` on
one store, and logs what a stage logs, over and over, for `--duration` seconds: a run created, its params and tags
in one batch, `--metric-batches` batches of `--metrics-per-batch` metric points (a training curve), the run ended.
The clients start together once all of them have imported MLflow and made their first call (not counted).
Reported per store and client count: runs and calls a second, the p50/p99 of one call, and errors (an exception
from a call: for a SQLite file written by several processes, `database is locked`), with the first error's text.
The stores are measured in the order given, each at every client count, on this machine: a server's own workers
share its cores with the clients. Prints a table and writes `benchmarks/results/tracking_load.json`.

Stand a server up as docs/mlflow.md says (`mlflow server --backend-store-uri postgresql://... --workers N`); a
`sqlite:///` URI is the file store each client opens directly, as `make run` does with `mlflow.db`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "tracking-load"
#: Seconds the clients are given to import MLflow and make their first call before the clock starts, and more for
#: each client (their imports share the machine's cores).
START_MARGIN_S = 20.0
MARGIN_PER_CLIENT_S = 3.0


def stage_like_run(client: Any, experiment_id: str, metric_batches: int, per_batch: int,
                   latencies: list[float]) -> int:
    """One run as a stage logs it; each call's seconds appended to `latencies`; returns the number of calls."""
    from mlflow.entities import Metric, Param, RunTag

    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        latencies.append(time.perf_counter() - t0)
        return out

    run = call(client.create_run, experiment_id, run_name=f"load-{uuid.uuid4().hex[:8]}")
    run_id = run.info.run_id
    call(client.log_batch, run_id, params=[Param(f"param_{i}", str(i)) for i in range(10)],
         tags=[RunTag("stage", "load"), RunTag("pipeline_run_id", run_id), RunTag("cpu", "bench")])
    now = int(time.time() * 1000)
    for b in range(metric_batches):
        call(client.log_batch, run_id, metrics=[Metric("train_loss", 1.0 / (s + 1), now, s)
                                                for s in range(b * per_batch, (b + 1) * per_batch)])
    call(client.set_terminated, run_id)
    return 3 + metric_batches


def client_process(uri: str, experiment_id: str, start_at: float, duration: float, metric_batches: int,
                   per_batch: int, out: Any) -> None:
    """One client: a warm-up run (not counted), then runs until `start_at + duration`; its counts to `out`. A run
    that ends after the window is logged but not counted (`late`): the rate divides by the window alone."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    result: dict[str, Any] = {"runs": 0, "calls": 0, "late": 0, "errors": 0, "first_error": None, "latencies": []}
    try:
        stage_like_run(client, experiment_id, 1, per_batch, [])
    except Exception as exc:  # the store refused even one run: reported, not raised in a child process
        result.update(errors=1, first_error=f"warm-up: {type(exc).__name__}: {exc}"[:300])
    time.sleep(max(0.0, start_at - time.time()))
    while time.time() < start_at + duration:
        try:
            calls = stage_like_run(client, experiment_id, metric_batches, per_batch, result["latencies"])
            if time.time() > start_at + duration:
                result["late"] += 1
            else:
                result["calls"] += calls
                result["runs"] += 1
        except Exception as exc:  # counted: what a stage would have seen as a failed MLflow call
            result["errors"] += 1
            result["first_error"] = result["first_error"] or f"{type(exc).__name__}: {exc}"[:300]
    out.put(result)


def measure(uri: str, clients: int, duration: float, metric_batches: int, per_batch: int,
            margin_s: float | None = None, label: str | None = None) -> dict[str, Any]:
    """`clients` processes on store `uri` for `duration` seconds, started `margin_s` after they are launched
    (default: `START_MARGIN_S` and `MARGIN_PER_CLIENT_S` a client); the row of the table. A client that is not
    ready by then starts late and counts what it did until the common end."""
    from mlflow.tracking import MlflowClient

    setup = MlflowClient(tracking_uri=uri)
    found = setup.get_experiment_by_name(EXPERIMENT)
    experiment_id = found.experiment_id if found else setup.create_experiment(EXPERIMENT)
    ctx = mp.get_context("spawn")  # a fresh interpreter a client, as separate stage processes are
    out = ctx.Queue()
    margin = START_MARGIN_S + MARGIN_PER_CLIENT_S * clients if margin_s is None else margin_s
    start_at = time.time() + margin
    procs = [ctx.Process(target=client_process, args=(uri, experiment_id, start_at, duration, metric_batches,
                                                      per_batch, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=margin + duration + 300) for _ in procs]
    for p in procs:
        p.join(30)
    from pipeline.evaluation.latency import percentiles

    latencies_ms = [1000 * x for r in results for x in r["latencies"]]
    # the benchmark stage's percentiles (p99 only from enough samples to be a tail), as serve_load reports them
    tail = percentiles(latencies_ms) if latencies_ms else dict.fromkeys(("p50", "p99"))
    errors = sum(r["errors"] for r in results)
    runs, calls = sum(r["runs"] for r in results), sum(r["calls"] for r in results)
    return {"store": uri, "label": label or uri, "clients": clients, "seconds": duration, "runs": runs,
            "late_runs": sum(r["late"] for r in results), "calls": calls,
            "runs_per_s": round(runs / duration, 2), "calls_per_s": round(calls / duration, 1),
            **{f"{q}_call_ms": None if tail[q] is None else round(tail[q], 1) for q in ("p50", "p99")},
            "errors": errors,
            "first_error": next((r["first_error"] for r in results if r["first_error"]), None)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| store | clients | runs/s | calls/s | p50 call ms | p99 call ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['clients']} | {r['runs_per_s']} | {r['calls_per_s']} | {r['p50_call_ms']} | "
              f"{r['p99_call_ms']} | {r['errors']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", required=True,
                        help="comma-separated stores: sqlite:///FILE (opened by every client) or a server's URL")
    parser.add_argument("--labels", default="",
                        help="comma-separated names of the stores, one each (what the server is: its backend and "
                             "workers), recorded beside each row; default: the URI")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each count is measured")
    parser.add_argument("--metric-batches", type=int, default=5, help="metric batches a run logs (its curve)")
    parser.add_argument("--metrics-per-batch", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tracking_load.json")
    args = parser.parse_args(argv)

    from benchmarks.provenance import provenance
    from pipeline.core.io import write_json

    uris = [u for u in args.tracking_uri.split(",") if u]
    labels = [n for n in args.labels.split(",") if n] or uris
    if len(labels) != len(uris):
        parser.error(f"--labels names {len(labels)} stores, --tracking-uri {len(uris)}")
    counts = [int(c) for c in args.clients.split(",") if c]
    rows = []
    for uri, label in zip(uris, labels, strict=True):
        for clients in counts:
            rows.append(measure(uri, clients, args.duration, args.metric_batches, args.metrics_per_batch,
                                label=label))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    write_json(args.out, {**provenance("benchmarks.tracking_load", argv), "rows": rows,
                          "run_shape": {"calls_per_run": 3 + args.metric_batches, "params": 10, "tags": 3,
                                        "metric_points": args.metric_batches * args.metrics_per_batch},
                          "start_margin_s": [START_MARGIN_S, MARGIN_PER_CLIENT_S]})
    print(table(rows))


if __name__ == "__main__":
    main()
