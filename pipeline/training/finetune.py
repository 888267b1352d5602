"""The `finetune` stage's work: train, keep the best checkpoint, score validation and test, save the model
in HF format with its record, and log it to MLflow with the machine's load during training (rank 0 only under
DDP)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline.core.io import save_figure, write_json, write_predictions
from pipeline.core.params import Params, TrainParams, to_dict
from pipeline.data.tokens import window_shortener
from pipeline.runtimes.fp32_linear import fp32_linear_on
from pipeline.training.checkpoints import CheckpointStore, ResumePlan, start_attempt
from pipeline.training.classifier import IMDBDataModule, OptimisationRecipe, SentimentClassifier, check_accelerations
from pipeline.training.curve_files import MetricSink
from pipeline.training.elastic import is_rank_zero
from pipeline.training.fingerprint import fingerprint, training_trajectory
from pipeline.training.loop import fit, predict_split, save_model, scoring_device, seed_run

if TYPE_CHECKING:
    from pipeline.core.machine import Choice
    from pipeline.core.parent_run import RunContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneOutputs:
    """Where finetuning writes: the stage's outputs in `dvc.yaml`."""

    model_dir: Path  # the best model, HF format, with its record (pipeline.json)
    metrics_path: Path
    plots_dir: Path  # the training curves
    report_dir: Path  # confusion matrix, profiler traces
    predictions_path: Path | None = None  # the test logits, which the evaluate stage reuses for its FP32 row


@dataclass(frozen=True)
class FinetuneResult:
    """What the finetune stage measured."""

    metrics: dict[str, Any]  # numbers, and what `auto` settings resolved to
    model_dir: Path
    best_checkpoint: str


def resolved_train(all_params: Params, precision: Choice) -> TrainParams:
    """`train` with `precision` as the stage resolved `train.precision` on this machine (`auto` included)."""
    return dataclasses.replace(all_params.train, precision=precision.value)


def checkpoint_store(train: TrainParams) -> CheckpointStore:
    """Where finetune's checkpoints go (`train.checkpoint_dir/finetune`) and how often (the one place that says so:
    the plan, the training loop and the MLflow attempt all read this store)."""
    return CheckpointStore.for_job(train, "finetune")


def finetune_plan(tokenized_dir: Path, all_params: Params, precision: Choice) -> ResumePlan:
    """Whether finetune resumes from `train.checkpoint_dir/finetune` (its fingerprint: the data, model and training
    settings that shape the weights, the tokenized splits, the training code) or starts fresh, and why. The
    precision is the resolved one: the same settings trained in bf16 elsewhere are another trajectory."""
    train = resolved_train(all_params, precision)
    settings = {"data": to_dict(all_params.data), "model": to_dict(all_params.model),
                "train": training_trajectory(train)}
    return checkpoint_store(all_params.train).plan(fingerprint(settings, [tokenized_dir]), all_params.train.resume)


def finetune(tokenized_dir: Path, outputs: FinetuneOutputs, all_params: Params, precision: Choice,
             metric_sink: MetricSink | None = None, plan: ResumePlan | None = None) -> FinetuneResult:
    """Train on `all_params`' data, model and train sections, keep the best checkpoint by validation accuracy,
    test it, and write `outputs` (the model in HF format).

    Checkpoints go to `train.checkpoint_dir/finetune` (outside DVC's outputs); `plan` (else `finetune_plan`) says
    whether this run continues an interrupted one. They are removed once the model is saved.
    `outputs.predictions_path` keeps the test logits, so the evaluate stage's FP32 reference row need not score
    the same model on the same reviews again.
    """
    from pipeline.data.tokens import tokenizer_of
    from pipeline.modeling import load_model, pad_id

    data, model_params = all_params.data, all_params.model
    log.info("train.precision: %s", precision.tag())
    params = resolved_train(all_params, precision)
    check_accelerations(params)
    if params.max_length is not None and params.max_length > data.max_length:
        raise ValueError(f"train.max_length ({params.max_length}) exceeds data.max_length ({data.max_length}), "
                         "the length the splits were tokenized to")
    started = time.perf_counter()
    plan = plan or finetune_plan(tokenized_dir, all_params, precision)
    store = checkpoint_store(params)
    seed_run(params)  # before the classifier head is initialised
    tokenizer = tokenizer_of(tokenized_dir)  # the one the splits were tokenized with, saved with the model
    model = load_model(model_params, seed=params.seed, attention_dropout=params.attention_dropout,
                       hidden_dropout=params.hidden_dropout)
    module = SentimentClassifier(model, OptimisationRecipe.of(params))
    shorten = window_shortener(params.max_length, data.max_length, data.truncation, data.head_fraction,
                               tokenizer.cls_token_id, tokenizer.sep_token_id)
    dm = IMDBDataModule(tokenized_dir, params, pad_id=pad_id(tokenizer), shorten_train=shorten)
    fitted = fit(module, params, store=store, plan=plan, position=dm.position, datamodule=dm, sink=metric_sink,
                 profiler_dir=outputs.report_dir / "profiler")
    if not fitted.trainer.is_global_zero:
        return FinetuneResult({}, outputs.model_dir, fitted.best_checkpoint)
    # Scored in one process over the whole test split (a DDP-sharded test loop would drop the tail).
    scored = time.perf_counter()
    logits, labels = predict_split(module, dm, "test")
    score_seconds = time.perf_counter() - scored
    preds = logits.argmax(-1)

    from sklearn.metrics import accuracy_score, f1_score

    curves = fitted.curves
    metrics = {
        "test_accuracy": float(accuracy_score(labels, preds)),
        "test_f1": float(f1_score(labels, preds)),
        "best_val_accuracy": fitted.best_score,
        "train_samples_per_s": curves.samples_per_s,
        "train_tokens_per_s": curves.tokens_per_s,
        "train_seconds": curves.train_seconds,
        "train_samples_seen": curves.samples,
        "wall_time_s": time.perf_counter() - started,  # this attempt's (a resumed run's excludes the first)
        "train_steps": fitted.steps,
        "precision": precision.value,  # what `train.precision` resolved to (text: not an MLflow metric)
        "train_attention": fitted.attention.value,  # the attention kernel it trained with (text, as `precision`)
        **plan.record(),  # resumed, resumed_from_step, resume_reason
    }
    save_model(module.model, tokenizer, outputs.model_dir, data, model_params, params,
               choices=[precision, fitted.attention])
    if outputs.predictions_path is not None:
        write_predictions(outputs.predictions_path, logits, labels, dm.datasets["test"].input_ids,
                          batch_size=params.eval_batch_size, seconds=round(score_seconds, 2),
                          threads=torch.get_num_threads(), device=scoring_device(dm), pad_id=dm.collate.pad_id,
                          fp32_linear=fp32_linear_on(scoring_device(dm)))
    write_json(outputs.metrics_path, metrics)
    curves.write(outputs.plots_dir)
    save_confusion(labels, preds, outputs.report_dir / "confusion_matrix.png")
    store.clear()  # the model is saved: nothing left to resume
    return FinetuneResult(metrics, outputs.model_dir, fitted.best_checkpoint)


def save_confusion(labels: np.ndarray, preds: np.ndarray, path: Path) -> None:
    """A labelled confusion-matrix image (counts and row-normalised share)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to touch
    from sklearn.metrics import confusion_matrix

    cm = confusion_matrix(labels, preds, labels=[0, 1])
    fig = Figure(figsize=(4, 3.6), dpi=120)
    ax = fig.subplots()
    ax.imshow(cm, cmap="Blues")
    names = ["negative", "positive"]
    ax.set_xticks([0, 1], names)
    ax.set_yticks([0, 1], names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i in range(2):
        share = cm[i] / max(cm[i].sum(), 1)
        for j in range(2):
            ax.text(j, i, f"{cm[i, j]}\n{share[j]:.1%}", ha="center", va="center",
                    color="white" if cm[i, j] > cm.max() / 2 else "black")
    ax.set_title(f"test accuracy {np.trace(cm) / max(cm.sum(), 1):.2%}")
    fig.tight_layout()
    save_figure(fig, path)


def run_finetune(*, tokenized_dir: Path, outputs: FinetuneOutputs, all_params: Params, precision: Choice,
                 run_context: RunContext | None) -> FinetuneResult:
    """Finetune inside an MLflow child run of the execution's parent (`run_context`) that samples the machine's
    load (`mlflow.system_metrics`); log curves, metrics and the model's files. A training worker of rank > 0
    logs nothing (rank zero logs for the group), and its stage passes no context (None). A run stopped by a signal
    (checkpoint written, to be resumed) ends KILLED (`stage_run`).

    Nothing is registered here: the registry holds the variant the package stage serves (`@champion`)."""
    from pipeline.core.tracking import stage_run

    if run_context is None or not is_rank_zero():
        return finetune(tokenized_dir, outputs, all_params, precision)

    plan = finetune_plan(tokenized_dir, all_params, precision)
    with stage_run(run_context, "finetune", system_metrics=all_params.mlflow.system_metrics) as run:
        run.log_sections({name: to_dict(getattr(all_params, name)) for name in ("data", "model", "train")})
        start_attempt(run, plan, checkpoint_store(all_params.train))
        result = finetune(tokenized_dir, outputs, all_params, precision, metric_sink=run.log_steps, plan=plan)
        run.log_metrics(result.metrics)
        run.set_tags({"train.precision.resolved": result.metrics["precision"],
                      "train.attention": result.metrics["train_attention"]})
        run.log_artifact(outputs.metrics_path)
        run.log_artifacts(outputs.plots_dir, "curves")
        run.log_artifacts(outputs.report_dir, "reports")
        run.log_artifacts(outputs.model_dir, "model")
        if outputs.predictions_path is not None and outputs.predictions_path.exists():
            run.log_artifact(outputs.predictions_path, "predictions")  # the logits evaluate's FP32 row reuses
    return result
