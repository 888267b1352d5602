"""Same review, same answer: what scoring a batch in one call does to each review's score, and what the
row-by-row scoring that prevents it costs, for every servable variant that is built.

    python -m benchmarks.batch_invariance --reviews 256 --rounds 3

Real IMDB test reviews go through `SentimentPredictor` (the served path: cleaning, truncation, tokenizer).
Per variant: each review's positive probability alone (batch 1, unpadded), then inside random batches of
`--batch-size` (mixed lengths, so padding differs), scored the way it is served (`auto`: one call per batch, or
row by row for a graph with per-tensor dynamic activation scales) and, where that differs, forced into one call
per batch (`batched`, what was served before). Reported: the largest |difference| from the review's answer
alone and the labels that flip, and reviews/s at batch 1 and at the batch size in each mode, measured in
alternating rounds (the best round counts; other processes on the machine slow single rounds). Prints a table
and writes `benchmarks/results/batch_invariance.json` with the CPU and its ISA flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core.io import write_json

ROOT = Path(__file__).resolve().parents[1]


def positive(predictor: Any, encoded: list[np.ndarray]) -> np.ndarray:
    """Positive-class probability of each review in `encoded`, scored as one `score` call."""
    return np.array([p.score if p.label == "positive" else 1.0 - p.score for p in predictor.score(encoded)])


def measure(directory: Path, texts: list[str], batch_size: int, rounds: int, seed: int) -> dict[str, Any]:
    """Differences from the answer alone and throughput, in the served mode and (when it differs) one call per
    batch."""
    from pipeline.deployment.inference import SentimentPredictor

    served = SentimentPredictor(directory)
    modes = {"served": served}
    if getattr(served.runner, "rows_alone", False):
        modes["one call per batch"] = SentimentPredictor(directory, batching="batched")
    encoded = served.encode(texts)
    alone = np.concatenate([positive(served, [e]) for e in encoded])
    order = np.random.default_rng(seed).permutation(len(encoded))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    out: dict[str, Any] = {"rows_alone": bool(getattr(served.runner, "rows_alone", False)),
                           "reviews": len(encoded), "batch_size": batch_size,
                           "mean_tokens": float(np.mean([len(e) for e in encoded]))}
    for mode, predictor in modes.items():
        got = np.empty(len(encoded))
        for idx in batches:
            got[idx] = positive(predictor, [encoded[i] for i in idx])
        out[mode] = {"max_abs_diff_vs_alone": float(np.abs(got - alone).max()),
                     "label_flips": int(((got > 0.5) != (alone > 0.5)).sum())}
    best: dict[str, float] = {}
    for _ in range(rounds):
        t = time.perf_counter()
        for e in encoded:
            served.score([e])
        best["batch 1"] = max(best.get("batch 1", 0.0), len(encoded) / (time.perf_counter() - t))
        for mode, predictor in modes.items():
            t = time.perf_counter()
            for idx in batches:
                predictor.score([encoded[i] for i in idx])
            key = f"batch {batch_size} {mode}"
            best[key] = max(best.get(key, 0.0), len(encoded) / (time.perf_counter() - t))
    out["reviews_per_s"] = best
    return out


def table(results: dict[str, dict[str, Any]], batch_size: int) -> str:
    lines = [f"| variant | served as | max diff served | flips served | max diff one call | flips one call "
             f"| rev/s b1 | rev/s b{batch_size} served | rev/s b{batch_size} one call |", "|" + "---|" * 9]
    for name, r in results.items():
        one = r.get("one call per batch", {})
        rate = r["reviews_per_s"]
        lines.append(
            f"| {name} | {'rows' if r['rows_alone'] else 'batched'} | {r['served']['max_abs_diff_vs_alone']:.1e} "
            f"| {r['served']['label_flips']} | {one.get('max_abs_diff_vs_alone', float('nan')):.1e} "
            f"| {one.get('label_flips', '-')} | {rate['batch 1']:.1f} | {rate[f'batch {batch_size} served']:.1f} "
            f"| {rate.get(f'batch {batch_size} one call per batch', float('nan')):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants-root", type=Path, default=ROOT / "models/variants")
    parser.add_argument("--variants", default="", help="comma-separated names (default: every servable one built)")
    parser.add_argument(
        "--imdb-dir", type=Path, default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb"))
    )
    parser.add_argument("--reviews", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/batch_invariance.json")
    args = parser.parse_args(argv)

    from benchmarks.provenance import provenance
    from pipeline.runtimes.catalog import VARIANTS
    from pipeline.runtimes.record import VARIANT_FILE, read_variant

    names = [n for n in args.variants.split(",") if n] or [v.name for v in VARIANTS if v.servable]
    texts = pd.read_parquet(args.imdb_dir / "test.parquet", columns=["text"])["text"].sample(
        n=args.reviews, random_state=0).tolist()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        directory = args.variants_root / name
        if not (directory / VARIANT_FILE).is_file() or read_variant(directory).status != "ok":
            print(f"{name}: not built here, skipped", file=sys.stderr)
            continue
        results[name] = measure(directory, texts, args.batch_size, args.rounds, seed=1)
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    report = {**provenance("benchmarks.batch_invariance", argv), "variants": results}
    write_json(args.out, report)  # written whole: an interrupted run leaves the previous file
    print(table(results, args.batch_size))


if __name__ == "__main__":
    main()
