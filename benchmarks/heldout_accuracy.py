"""Accuracy of the finetuned model on more reviews than the test subsample, at one or more inference lengths.

The default profile scores its test accuracy on 1,500 reviews: one standard error is about 0.9 point, too
coarse to say whether a model is at 87 or 88 %. The train split has ~30,000 reviews the CPU profile never
trains on (it subsamples 5,500, and the distill stage's unlabelled transfer reviews are excluded too); this
script scores `models/finetuned` on a stratified sample of them, the
same cleaning and truncation as the pipeline, at each `--lengths` value (the pipeline's own `data.max_length`
first, then longer inference lengths, which the pretrained position table covers up to 512).
They are not the test split: they serve as a larger validation set when a profile setting is chosen (the
inference length, the calibration size; `RESULTS.md` says which), never the test reviews. Prints a table and
writes `benchmarks/results/heldout_accuracy.json`.

`--variants int8-dynamic,int8-static,int8-qat` also scores those variants (at the pipeline's own length) on the
same reviews and reports each one's paired difference to FP32 with its standard error: the test split's
1,500 reviews cannot tell a 0.3 from a 0.7 point quantization loss.

    python -m benchmarks.heldout_accuracy [--reviews 3000 --lengths 128,256 --variants int8-static]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from benchmarks.provenance import provenance
from pipeline.core.io import write_json
from pipeline.core.params import DataParams, read_params, section
from pipeline.data.imdb import TRANSFER, load_imdb, make_splits
from pipeline.data.tokens import encode_texts
from pipeline.evaluation.accuracy import paired_se_pt, runner_for_test_split
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.base import predict_logits
from pipeline.runtimes.eager import TorchRunner, logits_module

ROOT = Path(__file__).resolve().parents[1]


def unseen_train_reviews(data: DataParams, imdb_dir: Path, trained_on: pd.DataFrame, n: int,
                         seed: int) -> pd.DataFrame:
    """A stratified sample of train-split reviews that the profile's subsample left out; `trained_on` holds every
    review a model of the profile saw (the training subsample and the distill stage's transfer reviews)."""
    full = dataclasses.replace(data, train_subsample=None, val_subsample=None, test_subsample=None,
                               transfer_reviews=0)
    splits, _ = make_splits(load_imdb(full, imdb_dir), full)
    unseen = splits["train"][~splits["train"]["text"].isin(set(trained_on["text"]))]
    if len(unseen) == 0:
        raise SystemExit("the profile trains on the whole train split: no unseen train reviews to score")
    if n >= len(unseen):
        return unseen.reset_index(drop=True)
    from sklearn.model_selection import train_test_split  # the split the pipeline's subsamples use

    kept, _ = train_test_split(unseen, train_size=n, stratify=unseen["label"], random_state=seed)
    return kept.reset_index(drop=True)


def main(argv: list[str] | None = None) -> None:
    """Score the finetuned model on unseen train-split reviews at each length."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--finetuned", type=Path, default=ROOT / "models/finetuned")
    parser.add_argument("--prepared", type=Path, default=ROOT / "data/prepared")
    parser.add_argument("--imdb-dir", type=Path, default=None,
                        help="default: IMDB_DIR or params data.local_dir")
    parser.add_argument("--reviews", type=int, default=3000)
    parser.add_argument("--lengths", default="", help="comma-separated; default: the pipeline's data.max_length")
    parser.add_argument("--variants", default="",
                        help="comma-separated variant names under --variants-dir, or LABEL=DIR for a variant "
                             "directory elsewhere (a candidate student's)")
    parser.add_argument("--variants-dir", type=Path, default=ROOT / "models/variants")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/heldout_accuracy.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    data = section(read_params(args.params), "data", DataParams)
    imdb_dir = args.imdb_dir or Path(os.environ.get("IMDB_DIR") or (ROOT / data.local_dir))
    model, tokenizer, meta = load_finetuned(args.finetuned)
    trained = meta["params"]["data"]
    if trained["train_subsample"] != data.train_subsample or trained["seed"] != data.seed:
        raise SystemExit(f"{args.finetuned} was trained with other data params than {args.params}; "
                         "run `make run` first")
    seen = [pd.read_parquet(p) for p in (args.prepared / "train.parquet", args.prepared / f"{TRANSFER}.parquet")
            if p.is_file()]  # the student also learnt from the transfer reviews (through the teacher's labels)
    reviews = unseen_train_reviews(data, imdb_dir, pd.concat(seen, ignore_index=True), args.reviews, args.seed)
    lengths = [int(x) for x in args.lengths.split(",") if x] or [trained["max_length"]]
    runner = TorchRunner(logits_module(model.eval()))
    labels = reviews["label"].to_numpy()
    pad = pad_id(tokenizer)
    variants = [v for v in args.variants.split(",") if v]
    if variants and trained["max_length"] not in lengths:
        lengths.append(trained["max_length"])  # the variants are compared with FP32 at the pipeline's length
    rows: dict[str, dict[str, Any]] = {}
    fp32_pred: np.ndarray | None = None
    for length in lengths:
        start = time.perf_counter()
        seqs = encode_texts(reviews["text"].tolist(), tokenizer, length, truncation=trained["truncation"],
                            head_fraction=trained["head_fraction"])
        pred = predict_logits(runner, seqs, 16, pad_id=pad, progress=f"{length} tokens").argmax(-1)
        acc = float((pred == labels).mean())
        rows[str(length)] = {"accuracy": acc, "std_error": math.sqrt(acc * (1 - acc) / len(labels)),
                             "seconds": time.perf_counter() - start}
        if length == trained["max_length"]:
            fp32_pred, fp32_seqs = pred, seqs
    by_variant: dict[str, dict[str, Any]] = {}
    for name in variants:
        start = time.perf_counter()
        label, _, where = name.partition("=")  # LABEL=DIR scores a variant directory outside --variants-dir
        directory = Path(where) if where else args.variants_dir / name
        # as the evaluate stage scores it: a variant scored by rows as one-thread calls on every core at once
        variant_runner, callers = runner_for_test_split(directory, args.threads)
        pred = predict_logits(variant_runner, fp32_seqs, 16, pad_id=pad, progress=label,
                              callers=callers).argmax(-1)
        by_variant[label] = paired_difference(pred, fp32_pred, labels) | {
            "seconds": time.perf_counter() - start,
            "scored_with": {**variant_runner.describe(), "concurrent_calls": callers}}
    window = meta["params"].get("train", {}).get("max_length") or trained["max_length"]
    result = {"reviews": len(labels), "source": "train split, reviews the profile did not train on",
              "data_max_length": trained["max_length"],
              "train_window": window,
              "train_subsample": trained["train_subsample"],
              "by_inference_length": rows, "variants_vs_fp32": by_variant,
              # INT8 accuracy can depend on the CPU's kernels (a saturating format on a CPU without VNNI)
              **provenance("benchmarks.heldout_accuracy", argv, threads=args.threads)}
    write_json(args.out, result)
    print(tables(result))


def tables(result: dict[str, Any]) -> str:
    """The accuracy per inference length and, where variants were scored, each one against FP32, as Markdown."""
    rows, by_variant, length_read = result["by_inference_length"], result["variants_vs_fp32"], result["data_max_length"]
    lines = [f"\n{result['reviews']} unseen train-split reviews (model trained on {result['train_window']}-token "
             f"windows, the pipeline reads {length_read})\n",
             "| inference length | accuracy | ± 1 s.e. | seconds |", "|---:|---:|---:|---:|"]
    lines += [f"| {length} | {100 * r['accuracy']:.2f} % | {100 * r['std_error']:.2f} | {r['seconds']:.0f} |"
              for length, r in rows.items()]
    if by_variant:
        lines += [f"\n| variant ({length_read} tokens) | accuracy | Δ vs FP32 (paired) | agreement | seconds |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {name} | {100 * r['accuracy']:.2f} % | {100 * r['delta']:+.2f} "
                  f"± {100 * r['delta_std_error']:.2f} pt | {100 * r['agreement']:.1f} % | {r['seconds']:.0f} |"
                  for name, r in by_variant.items()]
    return "\n".join(lines)


def paired_difference(pred: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy of `pred`, its difference to `reference` on the same reviews and that difference's standard
    error: evaluate's paired one (`paired_se_pt`, only reviews where the two disagree move it), as a fraction."""
    correct, reference_correct = pred == labels, reference == labels
    return {"accuracy": float(correct.mean()),
            "delta": float(correct.astype(float).mean() - reference_correct.astype(float).mean()),
            "delta_std_error": paired_se_pt(correct, reference_correct) / 100,
            "agreement": float((pred == reference).mean())}


if __name__ == "__main__":
    main()
