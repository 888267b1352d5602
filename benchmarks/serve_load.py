"""Load on the running sentiment endpoint vs the same handler code called in-process.

    make serve && python -m benchmarks.serve_load --concurrency 8 --duration 60

Traffic goes to loopback only, bounded in time and count. The in-process figure runs the archive's own
model and batching rule (one `SentimentPredictor.predict` per server-side batch of `batch_size` texts,
fed by the same number of concurrent callers), so the ratio isolates what the server adds.
Writes `benchmarks/results/serve_load.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def _texts(imdb_dir: Path, n: int) -> list[str]:
    df = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])
    return df["text"].sample(n=n, random_state=0).str.slice(0, 2000).tolist()


def served(
    url: str, key: str | None, texts: list[str], concurrency: int, duration: float, max_requests: int
) -> dict[str, Any]:
    """Closed-loop clients: each sends one review, waits for the answer, sends the next."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration
    counter = iter(range(max_requests))

    def worker(wid: int) -> None:
        nonlocal errors
        i = wid
        while time.perf_counter() < stop_at:
            with lock:
                if next(counter, None) is None:
                    return
            body = json.dumps({"text": texts[i % len(texts)]}).encode()
            req = urllib.request.Request(
                f"{url}/predictions/sentiment", data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            if key:
                req.add_header("Authorization", f"Bearer {key}")
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    ok = resp.status == 200 and "label" in json.loads(resp.read())
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
            with lock:
                if ok:
                    latencies.append((time.perf_counter() - t) * 1e3)
                else:
                    errors += 1
            i += concurrency

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - start
    lat = np.asarray(latencies)
    return {
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p95_ms": float(np.percentile(lat, 95)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "seconds": elapsed,
    }


def in_process(mar: Path, texts: list[str], concurrency: int, batch_size: int, duration: float) -> float:
    """Same model and handler batching in one process: callers enqueue, a batcher runs `batch_size` at once."""
    from pipeline.deployment.inference import SentimentPredictor

    with tempfile.TemporaryDirectory(prefix="mar-") as tmp:
        zipfile.ZipFile(mar).extractall(tmp)
        config = json.loads((Path(tmp) / "serving.json").read_text())
        predictor = SentimentPredictor(Path(tmp) / config["variant_dir"], threads=config.get("threads"))
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
        while time.perf_counter() < stop_at:
            batch = [jobs.get()]
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


def main(argv: list[str] | None = None) -> None:
    """Measure served vs in-process throughput and latency; print and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", type=Path, default=ROOT / "key_file.json")
    parser.add_argument("--mar", type=Path, default=ROOT / "model_store/sentiment.mar")
    parser.add_argument(
        "--imdb-dir", type=Path, default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb"))
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=8, help="the server's batchSize (config.properties)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve_load.json")
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise SystemExit("serve_load only targets loopback addresses")

    from serving.client import inference_key

    texts = _texts(args.imdb_dir, 512)
    key = inference_key(args.key_file)
    srv = served(args.url, key, texts, args.concurrency, args.duration, args.max_requests)
    local = in_process(args.mar, texts, args.concurrency, args.batch_size, args.duration)
    result = {
        **srv,
        "in_process_per_s": local,
        "served_vs_in_process": srv["requests_per_s"] / local,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "batch_size": args.batch_size,
    }
    result["targets"] = {
        "zero_errors": srv["errors"] == 0,
        "served_at_least_70pct_of_in_process": result["served_vs_in_process"] >= 0.7,
        "p99_at_most_3x_p50": srv["p99_ms"] is not None and srv["p99_ms"] <= 3 * srv["p50_ms"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for k in (
        "requests",
        "errors",
        "requests_per_s",
        "p50_ms",
        "p95_ms",
        "p99_ms",
        "in_process_per_s",
        "served_vs_in_process",
    ):
        v = result[k]
        print(f"{k:<24}{v:>12.2f}" if isinstance(v, float) else f"{k:<24}{v:>12}")
    print(json.dumps(result["targets"]))


if __name__ == "__main__":
    main()
