"""Load on a running sentiment endpoint, TorchServe or MLflow's scoring server, vs the same model called
in-process, with hostile requests mixed in.

    make serve && python -m benchmarks.serve_load --concurrency 1,8,32 --duration 60 --malformed-share 0.1
    make serve-mlflow &  # then:
    python -m benchmarks.serve_load --server mlflow --concurrency 1,8,32 --duration 60 --malformed-share 0.1

For each concurrency in the sweep, closed-loop clients send IMDB reviews (TorchServe: `{"text"}` to
`/predictions/sentiment`; MLflow: `{"dataframe_records": [{"text"}]}` to `/invocations`); `--malformed-share`
of the requests are malformed instead, drawn in turn from several kinds of poison (deep nesting, huge numbers,
lone surrogates, JSON scalars, invalid UTF-8, oversized bodies, too many texts, NaN, non-string and null
texts) in the server's own request format. Reported per concurrency: the share of valid requests answered
200, errors on valid requests, malformed requests answered 4xx, latency of valid requests (p50/p95/p99),
valid requests per second (over the wall time, and over the clients' time on valid requests, `valid_rate`,
which is what is compared with in-process, whose callers send no poison), and the in-process figure: the
archive's own model (the variant both servers serve) fed by the same number of concurrent callers, each
`SentimentPredictor.predict` taking what is queued, up to `batch_size` texts, without waiting for more, so the
ratio isolates what the server adds. Traffic goes
to loopback only, bounded in time and count, each client on one kept-open HTTP/1.1 connection as pooled clients
use them (`--new-connection-per-request` for one TCP connection per request). Each level starts with `--warmup`
seconds of valid requests at its concurrency that are not counted (recorded per row): before TorchServe's JIT was
limited to C1, a freshly started TorchServe served its first concurrency-1 level well below the same level run
again after the others (docs/serving.md#concurrency-1-on-torchserve). Prints a table and writes
`benchmarks/results/serve_load-<server>.json` (with the CPU, its ISA flags and the server's batching settings).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import tempfile
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks.load_clients import Connection, Endpoint, answering_endpoint, malformed_bodies
from pipeline.core.io import write_json
from pipeline.evaluation.latency import percentiles

ROOT = Path(__file__).resolve().parents[1]


def _texts(imdb_dir: Path, n: int) -> list[str]:
    df = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])
    return df["text"].sample(n=n, random_state=0).str.slice(0, 2000).tolist()


def served(endpoint: Endpoint, texts: list[str], *, concurrency: int, duration: float, max_requests: int,
           malformed_share: float, poison: Sequence[tuple[str, bytes, str]], reuse: bool = True) -> dict[str, Any]:
    """Closed-loop clients, each on its own `Connection`: each sends one request, waits for the answer, sends the
    next. Request number `n` is malformed when `floor(n * share)` steps up, so the share holds exactly over any
    run length."""
    latencies: list[float] = []
    valid_errors: dict[str, int] = {}
    malformed = {"sent": 0, "answered_4xx": 0, "client_s": 0.0}
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration
    counter = iter(range(max_requests))
    connections = [Connection(endpoint, reuse) for _ in range(concurrency)]

    def worker(connection: Connection) -> None:
        while time.perf_counter() < stop_at:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            is_bad = int((n + 1) * malformed_share) > int(n * malformed_share)
            if is_bad:
                _, body, content_type = poison[int(n * malformed_share) % len(poison)]
            else:
                body, content_type = endpoint.body(texts[n % len(texts)]), "application/json"
            t = time.perf_counter()
            status, answer = connection.post(body, content_type)
            elapsed = (time.perf_counter() - t) * 1e3
            with lock:
                if is_bad:
                    malformed["sent"] += 1
                    malformed["client_s"] += elapsed / 1e3
                    malformed["answered_4xx"] += int(status is not None and 400 <= status < 500)
                elif status == 200 and endpoint.answered(answer):
                    latencies.append(elapsed)
                else:
                    reason = "no answer" if status is None else f"HTTP {status}"
                    valid_errors[reason] = valid_errors.get(reason, 0) + 1

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in connections]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - start
    for c in connections:
        c.close()
    valid_sent = len(latencies) + sum(valid_errors.values())
    # the benchmark stage's percentiles (p99 only from enough samples to be a tail); none without an answer
    tail = percentiles(latencies) if latencies else dict.fromkeys(("p50", "p95", "p99"))
    return {
        "valid_sent": valid_sent,
        "valid_ok": len(latencies),
        "valid_ok_pct": 100.0 * len(latencies) / valid_sent if valid_sent else None,
        "valid_errors": sum(valid_errors.values()),
        "valid_error_kinds": valid_errors,
        "malformed_sent": malformed["sent"],
        "malformed_4xx_pct": 100.0 * malformed["answered_4xx"] / malformed["sent"] if malformed["sent"] else None,
        "requests_per_s": len(latencies) / elapsed,
        "malformed_client_s": malformed["client_s"],
        "valid_requests_per_s": valid_rate(len(latencies), concurrency, elapsed, malformed["client_s"]),
        **{f"{k}_ms": v for k, v in tail.items()},
        "seconds": elapsed,
        "connections_opened": sum(c.opened for c in connections),
        "reconnects": sum(c.reconnects for c in connections),
    }


def valid_rate(valid_ok: int, concurrency: int, elapsed: float, malformed_client_s: float) -> float:
    """Valid answers per second of the clients' time on valid requests: what `concurrency` closed-loop clients that
    sent only valid requests would get, the figure compared with the in-process rate (whose callers send only valid
    reviews). The wall-time rate (`requests_per_s`) also spends the clients' time waiting on malformed requests;
    the server-side cost of those stays in both (they still take the server's time from the valid ones)."""
    valid_client_s = concurrency * elapsed - malformed_client_s
    return valid_ok * concurrency / valid_client_s if valid_client_s > 0 else 0.0


def in_process(mar: Path, texts: list[str], concurrency: int, batch_size: int, duration: float) -> float:
    """Same model and handler batching in one process: callers enqueue, a batcher runs `batch_size` at once."""
    from pipeline.deployment.inference import SentimentPredictor

    with tempfile.TemporaryDirectory(prefix="mar-") as tmp:
        zipfile.ZipFile(mar).extractall(tmp)
        config = json.loads((Path(tmp) / "serving.json").read_text())
        predictor = SentimentPredictor(Path(tmp) / config["variant_dir"], threads=config.get("threads"),
                                       max_chars=config.get("max_chars_per_text"))
        predictor.predict(["warm-up"])
        jobs: queue.Queue = queue.Queue()
        done = 0
        stop_at = time.perf_counter() + duration

        def caller(wid: int) -> None:
            i = wid
            while time.perf_counter() < stop_at:
                ev = threading.Event()
                jobs.put((texts[i % len(texts)], ev))
                ev.wait()
                i += concurrency

        threads = [threading.Thread(target=caller, args=(w,), daemon=True) for w in range(concurrency)]
        start = time.perf_counter()
        for th in threads:
            th.start()
        while (left := stop_at - time.perf_counter()) > 0:
            try:  # bounded: the callers may all have seen the deadline and stopped queueing
                batch = [jobs.get(timeout=left)]
            except queue.Empty:
                break
            while len(batch) < batch_size:
                try:
                    batch.append(jobs.get_nowait())
                except queue.Empty:
                    break
            predictor.predict([t for t, _ in batch])
            done += len(batch)
            for _, ev in batch:
                ev.set()
        elapsed = time.perf_counter() - start
        while not jobs.empty():  # release callers still waiting
            jobs.get_nowait()[1].set()
        return done / elapsed


#: served / in-process rate each concurrency must reach (no batching tax on a lone client, no loss under load).
RATIO_TARGETS = {1: 0.8, 8: 0.8, 32: 0.8}


def targets(rows: list[dict[str, Any]], malformed_share: float) -> dict[str, bool | None]:
    """The endpoint's soak targets (None where this run's sweep or mix does not measure one)."""
    at = {r["concurrency"]: r for r in rows}
    at8 = at.get(8)
    result: dict[str, bool | None] = {
        "zero_errors_on_valid": all(r["valid_errors"] == 0 and r.get("warmup", {}).get("errors", 0) == 0
                                    for r in rows),
        "all_valid_answered_200_with_malformed_mixed_in": (
            all(r["valid_ok_pct"] == 100.0 for r in rows) if malformed_share > 0 else None),
        "p99_at_most_3x_p50_at_8": (at8["p99_ms"] <= 3 * at8["p50_ms"]
                                    if at8 and at8["p99_ms"] is not None else None),
    }
    for level, share in RATIO_TARGETS.items():
        ratio = at[level].get("served_vs_in_process") if level in at else None
        result[f"served_at_least_{share:g}_of_in_process_at_{level}"] = None if ratio is None else ratio >= share
    return result


def _concurrencies(value: str) -> list[int]:
    levels = [int(v) for v in value.split(",") if v.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--concurrency takes positive integers, e.g. 1,8,32")
    return levels


#: Where each server listens by default (`make serve`, `make serve-mlflow`).
DEFAULT_URLS = {"torchserve": "http://127.0.0.1:8080", "mlflow": "http://127.0.0.1:5001"}
TS_CONFIG = ROOT / "serving/config.properties"


def torchserve_batching(config_file: Path = TS_CONFIG) -> dict[str, Any]:
    """The sentiment model's batching settings (batchSize, maxBatchDelay, workers) in TorchServe's config file."""
    for line in config_file.read_text().splitlines():
        if line.startswith("models="):
            models = json.loads(line.split("=", 1)[1])
            entry = next(iter(models["sentiment"].values()))
            return {k: entry[k] for k in ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers") if k in entry}
    return {}


def main(argv: list[str] | None = None) -> None:
    """Measure served vs in-process throughput and latency per concurrency; print a table and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=sorted(DEFAULT_URLS), default="torchserve")
    parser.add_argument("--url", help="the server's address (default: its `make serve*` address)")
    parser.add_argument("--key-file", type=Path, default=ROOT / "key_file.json", help="TorchServe's inference key")
    parser.add_argument("--ts-config", type=Path, default=TS_CONFIG,
                        help="the config TorchServe was started with (its batching settings are recorded)")
    parser.add_argument("--mar", type=Path, default=ROOT / "model_store/sentiment.mar",
                        help="the archive; its variant is the one both servers serve")
    parser.add_argument(
        "--imdb-dir", type=Path, default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb"))
    )
    parser.add_argument("--concurrency", type=_concurrencies, default=[8], help="one level or a sweep: 1,8,32")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per concurrency (and in-process)")
    parser.add_argument("--malformed-share", type=float, default=0.0, help="share of malformed requests, 0-1")
    parser.add_argument("--warmup", type=float, default=15.0,
                        help="seconds of valid requests at each level's concurrency before it is measured, not "
                             "counted (a server's code paths for that load are compiled and its pools sized first)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="per concurrency level")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="in-process batches take up to this many queued texts (default: TorchServe's batchSize "
                             "in --ts-config)")
    parser.add_argument("--new-connection-per-request", action="store_true",
                        help="open and close a connection for every request instead of keeping one per client")
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process comparison")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="seconds to wait for the server to answer a first valid review before measuring")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/serve_load-<server>.json")
    args = parser.parse_args(argv)
    url = args.url or DEFAULT_URLS[args.server]
    if not url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise SystemExit("serve_load only targets loopback addresses")
    if not 0.0 <= args.malformed_share < 1.0:
        raise SystemExit("--malformed-share must be in [0, 1)")

    from benchmarks.provenance import provenance

    with zipfile.ZipFile(args.mar) as mar:
        config = json.loads(mar.read("serving.json"))
    ts_batching = torchserve_batching(args.ts_config)
    batch_size = args.batch_size or int(ts_batching.get("batchSize", 8))
    poison = malformed_bodies(int(config["max_body_bytes"]), int(config["max_texts"]), args.server)
    texts = _texts(args.imdb_dir, 512)
    endpoint = answering_endpoint(args.server, url, args.key_file, texts[0], args.ready_timeout)
    reuse = not args.new_connection_per_request
    rows = []
    for concurrency in args.concurrency:
        row: dict[str, Any] = {"concurrency": concurrency}
        if args.warmup > 0:
            warm = served(endpoint, texts, concurrency=concurrency, duration=args.warmup,
                          max_requests=args.max_requests, malformed_share=0.0, poison=poison, reuse=reuse)
            row["warmup"] = {"seconds": args.warmup, "requests": warm["valid_sent"], "errors": warm["valid_errors"]}
        row.update(served(endpoint, texts, concurrency=concurrency, duration=args.duration,
                          max_requests=args.max_requests, malformed_share=args.malformed_share, poison=poison,
                          reuse=reuse))
        if not args.no_in_process:
            row["in_process_per_s"] = in_process(args.mar, texts, concurrency, batch_size, args.duration)
            row["served_vs_in_process"] = row["valid_requests_per_s"] / row["in_process_per_s"]
        rows.append(row)
    result = {"server": args.server, "url": url, **provenance("benchmarks.serve_load", argv),
              "server_batching": ts_batching if args.server == "torchserve" else
              "coalesced in-process: predict calls that arrive while a forward pass runs are scored together in "
              "the next one (pipeline.deployment.coalescing, up to 64 texts, no delay)",
              "served_batching": config.get("served_batching"),
              "client_connections": "one kept open per client" if reuse else "a new one per request",
              "duration_s": args.duration, "warmup_s": args.warmup, "malformed_share": args.malformed_share,
              "in_process_batch_size": batch_size,
              "malformed_kinds": [kind for kind, _, _ in poison], "model": config.get("model"), "rows": rows,
              "targets": targets(rows, args.malformed_share)}
    out = args.out or ROOT / f"benchmarks/results/serve_load-{args.server}.json"
    write_json(out, result)  # written whole: an interrupted run leaves the previous file
    print(table(rows))
    print(json.dumps(result["targets"]))


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the sweep."""

    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = ["| concurrency | valid sent | valid 200 % | errors on valid | malformed 4xx % | p50 ms | p99 ms "
             "| valid req/s (wall) | valid req/s (their time) | in-process req/s | served/in-process |",
             "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['valid_sent']} | {fmt(r['valid_ok_pct'], '.2f')} | {r['valid_errors']} "
            f"| {fmt(r['malformed_4xx_pct'], '.1f')} | {fmt(r['p50_ms'], '.1f')} | {fmt(r['p99_ms'], '.1f')} "
            f"| {r['requests_per_s']:.1f} | {fmt(r.get('valid_requests_per_s'), '.1f')} "
            f"| {fmt(r.get('in_process_per_s'), '.1f')} "
            f"| {fmt(r.get('served_vs_in_process'), '.2f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
