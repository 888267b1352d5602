"""Finetuning speed: the reference blog's plain PyTorch loop vs this pipeline's accelerated Lightning path.

Both train the same model (the offline all-MiniLM-L6-v2) on the same IMDB reviews, in this one process
tree, with the same thread count, at the same maximum length (512 tokens) so the ratio reflects the
accelerations and not shorter inputs; a third run adds what the pipeline's shorter head+tail truncation
buys. Prints a table and writes `benchmarks/results/finetune_speed.json`.

    python -m benchmarks.finetune_speed [--train 192 --val 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from benchmarks.provenance import provenance
from pipeline.core.io import write_json
from pipeline.core.params import DataParams, ModelParams, Params, TrainParams, resolve_auto
from pipeline.data.cleaning import clean_text
from pipeline.data.tokens import tokenize_frame
from pipeline.modeling import load_model, load_tokenizer, pad_id
from pipeline.runtimes.base import predict_logits
from pipeline.runtimes.eager import TorchRunner, logits_module

ROOT = Path(__file__).resolve().parents[1]


def reviews(imdb_dir: Path, n_train: int, n_val: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Balanced random train reviews and held-out validation reviews from the shared copy."""
    df = pd.read_parquet(imdb_dir / "train.parquet")[["text", "label"]]
    df = df.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    df["text"] = df["text"].map(clean_text)
    return df.iloc[:n_train].reset_index(drop=True), df.iloc[n_train : n_train + n_val].reset_index(drop=True)


def plain_loop(train: pd.DataFrame, model_params: ModelParams, seed: int) -> tuple[Any, float]:
    """The blog's loop: fp32, every review padded to 512 tokens, Adam lr 5e-5, batch 12."""
    tok = load_tokenizer(model_params)
    model = load_model(model_params, seed=seed).train()
    enc = tok(train["text"].tolist(), padding="max_length", truncation=True, max_length=512, return_tensors="pt")
    labels = torch.tensor(train["label"].to_numpy())
    opt = torch.optim.Adam(model.parameters(), lr=5e-5)
    from tqdm.auto import tqdm

    start = time.perf_counter()
    for i in tqdm(range(0, len(train), 12), desc="plain loop", unit="batch"):
        out = model(
            input_ids=enc["input_ids"][i : i + 12],
            attention_mask=enc["attention_mask"][i : i + 12],
            labels=labels[i : i + 12],
        )
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return model, time.perf_counter() - start


def pipeline_path(
    train: pd.DataFrame, val: pd.DataFrame, model_params: ModelParams, data: DataParams, params: TrainParams
) -> tuple[Any, float]:
    """The finetune stage's own module, data module, sampler and Trainer (validation off while timing)."""
    import lightning as L

    from pipeline.training.classifier import IMDBDataModule, OptimisationRecipe, SentimentClassifier
    from pipeline.training.curves import CurveRecorder
    from pipeline.training.loop import build_trainer

    tok = load_tokenizer(model_params)
    with tempfile.TemporaryDirectory(prefix="ftspeed-") as tmp:
        d = Path(tmp)
        for split, frame in (("train", train), ("val", val), ("test", val)):
            tokenize_frame(frame, tok, data).to_parquet(d / f"{split}.parquet")
        L.seed_everything(params.seed, verbose=False)
        module = SentimentClassifier(
            load_model(model_params, seed=params.seed, attention_dropout=params.attention_dropout),
            OptimisationRecipe.of(params),
        )
        dm = IMDBDataModule(d, params, pad_id=pad_id(tok))
        recorder = CurveRecorder()
        trainer = build_trainer(params, d, [recorder], logger=False)
        trainer.limit_val_batches = 0
        trainer.fit(module, datamodule=dm)
    return module.model, recorder.train_seconds


def val_accuracy(model: Any, val: pd.DataFrame, model_params: ModelParams, data: DataParams) -> float:
    """Accuracy on the validation reviews, scored identically for every run (512 tokens, no padding waste)."""
    tok = load_tokenizer(model_params)
    seqs = tokenize_frame(val, tok, data)["input_ids"].tolist()
    logits = predict_logits(TorchRunner(logits_module(model.eval())), seqs, batch_size=32)
    return float((logits.argmax(-1) == val["label"].to_numpy()).mean())


def training_settings(*, seed: int, threads: int, compile_model: bool) -> TrainParams:
    """The default profile's training settings (`train`, attention dropout off included) for one epoch, with each
    `auto` resolved for this machine as a stage resolves it (`train.precision`: bf16 where the CPU has it)."""
    defaults = Params()
    train = resolve_auto(defaults).apply(defaults).train
    return dataclasses.replace(train, epochs=1, compile=compile_model, seed=seed, threads=threads)


def main(argv: list[str] | None = None) -> None:
    """Run the three trainings and write the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--imdb-dir", type=Path, default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb"))
    )
    parser.add_argument("--train", type=int, default=192)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--compile", action="store_true", help="also torch.compile the pipeline path")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/finetune_speed.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_params = ModelParams()
    train, val = reviews(args.imdb_dir, args.train, args.val, args.seed)
    full = DataParams(max_length=512, truncation="head")
    params = training_settings(seed=args.seed, threads=args.threads, compile_model=args.compile)

    rows: dict[str, dict[str, Any]] = {}
    model, secs = plain_loop(train, model_params, args.seed)
    rows["baseline_plain_512"] = {"seconds": secs, "val_accuracy": val_accuracy(model, val, model_params, full)}
    model, secs = pipeline_path(train, val, model_params, full, params)
    rows["pipeline_512"] = {"seconds": secs, "val_accuracy": val_accuracy(model, val, model_params, full)}
    short = DataParams(max_length=128, truncation="head_tail")
    model, secs = pipeline_path(train, val, model_params, short, params)
    rows["pipeline_128_head_tail"] = {"seconds": secs, "val_accuracy": val_accuracy(model, val, model_params, short)}
    for r in rows.values():
        r["samples_per_s"] = args.train / r["seconds"]

    base = rows["baseline_plain_512"]["samples_per_s"]
    result = {
        "baseline_samples_per_s": base,
        "pipeline_samples_per_s": rows["pipeline_512"]["samples_per_s"],
        "speedup": rows["pipeline_512"]["samples_per_s"] / base,
        "baseline_val_accuracy": rows["baseline_plain_512"]["val_accuracy"],
        "pipeline_val_accuracy": rows["pipeline_512"]["val_accuracy"],
        "short_truncation_samples_per_s": rows["pipeline_128_head_tail"]["samples_per_s"],
        "short_truncation_speedup": rows["pipeline_128_head_tail"]["samples_per_s"] / base,
        "short_truncation_val_accuracy": rows["pipeline_128_head_tail"]["val_accuracy"],
        "runs": rows,
        **provenance("benchmarks.finetune_speed", argv, threads=args.threads),
        "setup": {
            "model": "all-MiniLM-L6-v2 (packaged)",
            "train_reviews": args.train,
            "val_reviews": args.val,
            "threads": args.threads,
            "compile": args.compile,
            "pipeline_params": {
                "batch_size": params.batch_size,
                "lr": params.lr,
                "bucketing": params.bucketing,
                "precision": params.precision,
                "attention_dropout": params.attention_dropout,
            },
        },
    }
    write_json(args.out, result)  # written whole: an interrupted run leaves the previous file
    print(f"\n{'run':<26}{'samples/s':>12}{'speedup':>10}{'val acc':>10}")
    for name, r in rows.items():
        print(
            f"{name:<26}{r['samples_per_s']:>12.2f}{r['samples_per_s'] / base:>9.2f}x{100 * r['val_accuracy']:>9.1f}%"
        )
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
