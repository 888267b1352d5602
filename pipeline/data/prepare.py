"""The `prepare` stage: IMDB source -> clean, checked splits -> token ids, cached for `finetune`."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.io import directory_replaced_on_success, write_json
from pipeline.core.params import DataParams, Params, to_dict
from pipeline.data.imdb import SPLITS, TRANSFER, load_imdb, make_splits
from pipeline.data.tokens import tokenize_frame

if TYPE_CHECKING:
    from pipeline.core.parent_run import RunContext

log = logging.getLogger(__name__)

#: The file `save_pretrained` writes for every tokenizer (fast or slow), after which the tokenized folder is whole.
TOKENIZER_COMPLETE = "tokenizer/tokenizer_config.json"


def prepare(data: DataParams, tokenizer: Any, prepared_dir: Path, tokenized_dir: Path,
            metrics_path: Path) -> dict[str, Any]:
    """Write `{train,val,test}.parquet` (clean text), `transfer.parquet` (text only) when `data.transfer_reviews`
    asks for it, and their tokenized twins (by `tokenizer`, saved beside them); returns the metrics."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    frame = load_imdb(data)
    splits, report = make_splits(frame, data)
    metrics: dict[str, Any] = {**dataclasses.asdict(report)}
    # Both folders are built aside and swapped in whole (a killed run leaves the previous ones, never a part of a
    # split), and hold only this run's splits: a transfer split of an earlier run does not outlive
    # data.transfer_reviews. The tokenizer, saved last, marks the tokenized folder complete.
    with (directory_replaced_on_success(prepared_dir, complete_when="test.parquet") as prepared_work,
          directory_replaced_on_success(tokenized_dir, complete_when=TOKENIZER_COMPLETE) as tokenized_work):
        for name in tqdm(list(splits), desc="tokenize", unit="split"):
            df = splits[name]
            df.to_parquet(prepared_work / f"{name}.parquet", index=False)
            tok = tokenize_frame(df, tokenizer, data)
            tok.to_parquet(tokenized_work / f"{name}.parquet", index=False)
            lengths = tok["length"].to_numpy()
            metrics[f"{name}_tokens_mean"] = round(float(lengths.mean()), 1)
            metrics[f"{name}_tokens_p95"] = float(np.percentile(lengths, 95))
            metrics[f"{name}_truncated_share"] = round(float(tok["truncated"].mean()), 4)
        tokenizer.save_pretrained(tokenized_work / "tokenizer")
    metrics["wall_time_s"] = round(time.perf_counter() - started, 2)
    write_json(metrics_path, metrics)
    log.info("prepared splits %s", report.sizes)
    return metrics


#: The MLflow input context of each split.
SPLIT_CONTEXTS = {"train": "training", "val": "validation", "test": "test", TRANSFER: "distillation"}


def run_prepare_stage(*, params: Params, tokenizer: Any, prepared_dir: Path, tokenized_dir: Path,
                      metrics_path: Path, run_context: RunContext) -> dict[str, Any]:
    """`prepare` inside an MLflow child run of the execution's parent (`run_context`): its params sections,
    metrics and statuses, and each prepared split recorded as a dataset input (`mlflow.log_input`: source,
    schema, rows and a digest of the content). `tokenizer` is the model's
    (`pipeline.modeling.load_tokenizer(params.model)`), loaded by the caller so that a bad model source fails
    before 45k reviews are read."""
    import pandas as pd

    from pipeline.core.tracking import stage_run

    with stage_run(run_context, "prepare") as run:
        run.log_sections({"data": to_dict(params.data), "model": to_dict(params.model)})
        metrics = prepare(params.data, tokenizer, prepared_dir, tokenized_dir, metrics_path)
        run.log_report(metrics, [metrics_path])
        hub = params.data.source == "hub"
        written = [s for s in (*SPLITS, TRANSFER) if (prepared_dir / f"{s}.parquet").is_file()]
        for split in written:
            frame = pd.read_parquet(prepared_dir / f"{split}.parquet")
            digest = run.log_dataset(frame, f"imdb-{split}", SPLIT_CONTEXTS[split],
                                     params.data.hub_name if hub else params.data.local_dir,
                                     hub_revision=params.data.hub_revision if hub else None,
                                     targets="label" if "label" in frame.columns else None)
            log.info("%s split logged to MLflow as imdb-%s (digest %s)", split, split, digest)
    return metrics
