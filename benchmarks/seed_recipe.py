"""Training speed of the seed recipe's steps on one device: fp32 vs AMP vs AMP + torch.compile, same model and
batches, then the pipeline's own recipe (length buckets, dynamic padding, fused attention in training).

The reference blog finetunes DistilBERT on IMDB with batch 12, Adam/AdamW at 5e-5, every review padded to 512
tokens: plain PyTorch fp32, then AMP, then more. Here every row trains the same architecture on the same
reviews for the same number of optimizer steps; the first `--warmup` steps (compilation included) are not
timed, and the clock is read after a CUDA synchronisation at both ends.

- `plain-fp32`: the blog's hand-written loop (fp32, Adam, padded to 512).
- `lightning-<precision>[+compile]`: this pipeline's LightningModule and Trainer (`pipeline.training`),
  every batch padded to 512 (`pad_to_multiple_of: 512`, no buckets), so only precision and compilation differ.
  Mixed precision is 16-mixed on CUDA and, on a CPU, bf16-mixed only where the CPU has native bf16 (what
  `train.precision: auto` picks; the recipe rows train in that precision too).
- `pipeline-recipe`: the same plus length-bucketed batches with dynamic padding and attention dropout off
  (PyTorch's fused attention kernel also runs in training), i.e. what the finetune stage does;
  `pipeline-recipe-eager` is the same without torch.compile. Varying batch shapes can make torch.compile
  compile again inside the timed steps: `graphs_compiled_while_timed` in the JSON counts those.
- On CUDA, ways around cuDNN's fused attention planning a graph for every new sequence length (docs/training.md):
  `pipeline-recipe-eager-pad64` pads buckets to multiples of 64, `pipeline-recipe-eager-no-cudnn-sdpa` turns the
  cuDNN attention backend off (SDPA picks another kernel); `pipeline-recipe-pad64`: the compiled recipe, pad 64.
- `+cudagraphs` rows (CUDA): torch.compile's `reduce-overhead` mode, which replays each shape's recorded CUDA graph.

`--profile-steps N`: N steps of each row after its warm-up under torch.profiler, op tables (device and host time,
the CUDA allocator's counters) beside `--out`; a profiled row's rate is slower.

`--weights random` (the default): the architecture from its config, random weights (throughput does not depend on
them, accuracy does: none is reported). Minutes = the blog's 3 epochs × 35,000 reviews at the measured rate.
Prints a table and writes `benchmarks/results/seed_recipe.json`.

    python -m benchmarks.seed_recipe --model distilbert --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from benchmarks.provenance import provenance
from pipeline.core.io import replaced_on_success, write_json
from pipeline.core.machine import resolve_precision
from pipeline.core.params import DataParams, ModelParams, TrainParams
from pipeline.data.cleaning import clean_text
from pipeline.data.tokens import tokenize_frame
from pipeline.modeling import ID2LABEL, LABEL2ID, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BLOG_SAMPLES = 3 * 35_000  # the reference: 3 epochs over the 35k training split
BLOG_BATCH = 12
BLOG_LR = 5e-5
SEQ = 512
NO_CUDNN_SDPA = "pipeline-recipe-eager-no-cudnn-sdpa"  # the row run with PyTorch's cuDNN attention backend off
CUDAGRAPHS = {"compile_mode": "reduce-overhead"}  # torch.compile's mode that records and replays CUDA graphs


def build_model(name: str, weights: str) -> Any:
    """The architecture to time: `distilbert` (distilbert-base-uncased) or `minilm` (all-MiniLM-L6-v2)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, DistilBertConfig

    labels = {"num_labels": 2, "id2label": ID2LABEL, "label2id": LABEL2ID}
    if weights == "hub":
        hub = {"distilbert": "distilbert-base-uncased", "minilm": "sentence-transformers/all-MiniLM-L6-v2"}[name]
        return AutoModelForSequenceClassification.from_pretrained(hub, **labels)
    if name == "distilbert":
        config = DistilBertConfig(**labels)  # its defaults are distilbert-base-uncased's architecture
    else:
        from pipeline.modeling import packaged_model_dir

        config = AutoConfig.from_pretrained(packaged_model_dir(), **labels)
    return AutoModelForSequenceClassification.from_config(config)


class StepClock:
    """Wall time of the steps after the first `warmup`, bracketed by device synchronisations."""

    def __init__(self, warmup: int, device: str, profile_steps: int = 0, profile_out: Path | None = None) -> None:
        self.warmup, self.device = warmup, device
        # `profile_steps` > 0: torch.profiler records that many steps after the warm-up and writes its op tables to
        # `profile_out` (slower while it records, so a profiled row's rate is not comparable with the others)
        self.profile_steps, self.profile_out = profile_steps, profile_out
        self._profiler: Any = None
        self.samples = self.steps = 0
        self.tokens = 0.0
        self._tokens: torch.Tensor | None = None  # summed on the device: reading it each step would sync
        self.start: float | None = None
        self.seconds = 0.0
        self.graphs_at_start = 0
        self.graphs_compiled_while_timed = 0  # compilations inside the timed window (recompiles for new shapes)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def before(self, step: int) -> None:
        if step == self.warmup:
            self.sync()
            self.graphs_at_start = compiled_graphs()
            if self.profile_steps:
                kinds = torch.profiler.ProfilerActivity
                activities = [kinds.CPU, kinds.CUDA] if self.device == "cuda" else [kinds.CPU]
                self._profiler = torch.profiler.profile(activities=activities)
                self._profiler.__enter__()
            self.start = time.perf_counter()

    def after(self, step: int, batch: dict[str, torch.Tensor]) -> None:
        if step >= self.warmup:
            self.steps += 1
            self.samples += len(batch["labels"])
            count = batch["attention_mask"].sum()
            self._tokens = count if self._tokens is None else self._tokens + count
            if self._profiler is not None and self.steps == self.profile_steps:
                self._write_profile()

    def _write_profile(self) -> None:
        """Stop the profiler and write its op tables (by device time and by host time) and allocator counters."""
        self.sync()
        self._profiler.__exit__(None, None, None)
        averages = self._profiler.key_averages()
        tables = [f"{self.profile_steps} steps after {self.warmup} warm-up steps"]
        for key in (("self_cuda_time_total",) if self.device == "cuda" else ()) + ("self_cpu_time_total",):
            tables.append(f"## by {key}\n" + averages.table(sort_by=key, row_limit=30, max_name_column_width=60))
        if self.device == "cuda":
            stats = torch.cuda.memory_stats()
            tables.append("## allocator\n" + json.dumps({k: stats.get(k) for k in (
                "num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.allocated",
                "reserved_bytes.all.peak")}, indent=1))
        assert self.profile_out is not None
        with replaced_on_success(self.profile_out) as tmp:
            tmp.write_text("\n\n".join(tables) + "\n")
        print(f"profile written to {self.profile_out}", flush=True)
        self._profiler = None

    def stop(self) -> None:
        self.sync()
        if self.start is not None:
            self.seconds = time.perf_counter() - self.start
            self.graphs_compiled_while_timed = compiled_graphs() - self.graphs_at_start
        if self._tokens is not None:
            self.tokens = float(self._tokens)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (one more per recompilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def plain_loop(model: Any, ids: list[np.ndarray], labels: np.ndarray, steps: int, clock: StepClock, batch: int) -> None:
    """The blog's loop: fp32, every review padded to 512 tokens, Adam at 5e-5, `batch` reviews a step."""
    from pipeline.runtimes.base import pad_batch

    model.to(clock.device).train()
    opt = torch.optim.Adam(model.parameters(), lr=BLOG_LR)
    for step in range(steps):
        idx = range(step * batch, (step + 1) * batch)
        input_ids, mask = pad_batch([ids[i] for i in idx], width=SEQ)
        arrays = {"input_ids": input_ids, "attention_mask": mask, "labels": labels[list(idx)]}
        tensors = {key: torch.from_numpy(value).to(clock.device) for key, value in arrays.items()}
        clock.before(step)
        loss = model(**tensors).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.after(step, tensors)
    clock.stop()


def lightning_run(model: Any, tokenized: Path, params: TrainParams, clock: StepClock, pad_id: int = 0,
                  shorten_train: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    """The finetune stage's module, data module and Trainer, validation off (`shorten_train`: the stage's training
    window, `pipeline.data.tokens.window_shortener`; None trains on the reviews as tokenized)."""
    import lightning as L

    from pipeline.training.classifier import IMDBDataModule, OptimisationRecipe, SentimentClassifier
    from pipeline.training.loop import build_trainer

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            clock.before(batch_idx)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            clock.after(batch_idx, batch)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            clock.stop()

    L.seed_everything(params.seed, verbose=False)
    module = SentimentClassifier(model, OptimisationRecipe.of(params))
    with tempfile.TemporaryDirectory(prefix="seed-recipe-") as tmp:
        trainer = build_trainer(params, Path(tmp), [Clock()], enable_progress_bar=False)
        trainer.limit_val_batches = 0
        trainer.fit(module, datamodule=IMDBDataModule(tokenized, params, pad_id, shorten_train))


def runs(compile_ok: bool, device: str, cpu_precision: str = "32-true") -> list[tuple[str, dict[str, Any]]]:
    """(row name, TrainParams overrides) in table order. The mixed-precision rows and the recipe train in what the
    device trains in: 16-mixed on CUDA; on a CPU `cpu_precision`, what `train.precision: auto` resolves to there
    (bf16-mixed only with native bf16: emulated bf16 on an AVX2 CPU is several times slower than fp32 and would
    time the emulation, not the recipe), so a CPU without it gets no half-precision row and a 32-true recipe."""
    cuda = device == "cuda"
    rows: list[tuple[str, dict[str, Any]]] = [("lightning-32-true", {"precision": "32-true"})]
    half = "16-mixed" if cuda else cpu_precision
    if half != "32-true":
        rows.append((f"lightning-{half}", {"precision": half}))
    if compile_ok:
        rows.append((f"lightning-{half}+compile", {"precision": half, "compile": True}))
        if cuda and torch.cuda.is_bf16_supported():
            rows.append(("lightning-bf16-mixed+compile", {"precision": "bf16-mixed", "compile": True}))
        if cuda:  # CUDA graphs: each recorded shape replays without the host launching every kernel again
            rows.append((f"lightning-{half}+cudagraphs", {"precision": half, "compile": True, **CUDAGRAPHS}))
    recipe = {"precision": half, "bucketing": True, "pad_to_multiple_of": 8, "attention_dropout": 0.0}
    # one name per configuration, whatever `--no-compile` says: `--rows pipeline-recipe-eager` always finds it
    rows.append(("pipeline-recipe-eager", {**recipe, "compile": False}))
    if cuda:
        rows.append(("pipeline-recipe-eager-pad64", {**recipe, "compile": False, "pad_to_multiple_of": 64}))
        rows.append((NO_CUDNN_SDPA, {**recipe, "compile": False}))
    if compile_ok:
        rows.append(("pipeline-recipe", {**recipe, "compile": True}))
        if cuda:
            pad64 = {**recipe, "compile": True, "pad_to_multiple_of": 64}
            rows += [("pipeline-recipe-pad64", pad64), ("pipeline-recipe-pad64+cudagraphs", {**pad64, **CUDAGRAPHS})]
    return rows


def training_reviews(imdb_dir: Path, n: int) -> pd.DataFrame:
    """`n` cleaned train-split reviews tokenized at `SEQ` tokens (head truncation) with the BERT uncased
    vocabulary both architectures use."""
    frame = pd.read_parquet(imdb_dir / "train.parquet")[["text", "label"]]
    frame = frame.sample(n=n, random_state=0).reset_index(drop=True)
    frame["text"] = frame["text"].map(clean_text)
    return tokenize_frame(frame, load_tokenizer(ModelParams()), DataParams(max_length=SEQ, truncation="head"))


def table(out: dict[str, Any]) -> str:
    """Each row's rate, its ratio to plain fp32's (the first row's without it) and the blog's 3 epochs at that rate."""
    ref = out["rows"].get("plain-fp32", next(iter(out["rows"].values())))["samples_per_s"]
    lines = [f"\n{out['model']} ({out['weights']} weights) on {out['gpu'] or 'CPU'}, batch {out['batch_size']}, "
             f"{out['timed_steps']} timed steps", f"{'row':<32}{'samples/s':>11}{'vs plain':>10}{'3-epoch min*':>14}"]
    lines += [f"{name:<32}{r['samples_per_s']:>11.1f}{r['samples_per_s'] / ref:>9.2f}x"
              f"{r['blog_3_epochs_min_at_this_rate']:>14.2f}" for name, r in out["rows"].items()]
    return "\n".join([*lines, f"* {out['note']}"])


def main(argv: list[str] | None = None) -> None:
    """Time every row and write the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--imdb-dir", type=Path,
                        default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb")))
    parser.add_argument("--model", choices=["distilbert", "minilm"], default="distilbert")
    parser.add_argument("--weights", choices=["random", "hub"], default="random")
    parser.add_argument("--steps", type=int, default=300, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=BLOG_BATCH, help="reviews a step (the blog's 12; the stage's 16)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--rows", default="", help="comma-separated subset of row names (an unknown one is an error)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/seed_recipe.json")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="record this many timed steps of each row with torch.profiler (op tables beside --out)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = args.warmup + args.steps
    tokens = training_reviews(args.imdb_dir, total * args.batch)
    ids = tokens["input_ids"].tolist()
    labels = tokens["label"].to_numpy().astype(np.int64)

    results: dict[str, dict[str, Any]] = {}
    wanted = set(filter(None, args.rows.split(",")))
    with tempfile.TemporaryDirectory(prefix="seed-tok-") as tmp:
        tokenized = Path(tmp)
        tokens.to_parquet(tokenized / "train.parquet")
        for split in ("val", "test"):  # the Trainer's loaders need them; validation is off
            tokens.iloc[:args.batch].to_parquet(tokenized / f"{split}.parquet")
        base = TrainParams(epochs=1, batch_size=args.batch, lr=BLOG_LR, warmup_ratio=0.0, accelerator=device,
                           bucketing=False, pad_to_multiple_of=SEQ, attention_dropout=None, max_length=None,
                           val_checks_per_epoch=1)
        plan: list[tuple[str, dict[str, Any] | None]] = [("plain-fp32", None)]
        plan += runs(not args.no_compile, device, resolve_precision("auto", "cpu").value)
        if unknown := wanted - {name for name, _ in plan}:
            raise SystemExit(f"--rows names no row here: {sorted(unknown)}; rows: {[name for name, _ in plan]}")
        for name, overrides in plan:
            if wanted and name not in wanted:
                continue
            torch.manual_seed(0)
            model = build_model(args.model, args.weights)
            clock = StepClock(args.warmup, device, args.profile_steps,
                              args.out.with_name(f"{args.out.stem}-{name}-profile.txt"))
            cudnn_sdpa = name != NO_CUDNN_SDPA
            torch.backends.cuda.enable_cudnn_sdp(cudnn_sdpa)  # a flag only, on a CPU
            started = time.perf_counter()
            try:
                if overrides is None:
                    plain_loop(model, ids, labels, total, clock, args.batch)
                else:
                    lightning_run(model, tokenized, TrainParams(**{**base.__dict__, **overrides}), clock)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(True)
            rate = clock.samples / clock.seconds
            results[name] = {"samples_per_s": rate, "tokens_per_s": clock.tokens / clock.seconds,
                             "timed_steps": clock.steps, "timed_seconds": clock.seconds,
                             "wall_seconds_with_warmup": time.perf_counter() - started,
                             "blog_3_epochs_min_at_this_rate": BLOG_SAMPLES / rate / 60, "settings": overrides or {},
                             "graphs_compiled_while_timed": clock.graphs_compiled_while_timed,
                             "cudnn_sdpa_enabled": cudnn_sdpa if device == "cuda" else None}
            print(f"{name}: {rate:.1f} samples/s", flush=True)
            del model
            torch.cuda.empty_cache()  # nothing to do where CUDA never started

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    out = {"model": args.model, "weights": args.weights, "device": device, "gpu": gpu, "torch": torch.__version__,
           "batch_size": args.batch, "max_length": SEQ, "warmup_steps": args.warmup, "timed_steps": args.steps,
           **provenance("benchmarks.seed_recipe", argv, threads=torch.get_num_threads()), "rows": results,
           "note": "minutes = the blog's 3 epochs x 35,000 reviews at the measured rate (a projection, not a run)"}
    write_json(args.out, out)  # written whole: an interrupted run leaves the previous file
    print(f"{table(out)}\nwritten to {args.out}")


if __name__ == "__main__":
    main()
