"""The `distill` stage's training: a shallower student initialised from the finetuned teacher and trained to
imitate it.

This module runs the stage's work (label, train, save, record, MLflow); the student is cut by
`pipeline.surgery.student`, trained by `pipeline.training.student_classifier` on the targets of
`pipeline.training.labelling`.

The recipe is DistilBERT's (Sanh et al., 2019), for a finetuned classifier: the student keeps the teacher's
embeddings, classifier head and an evenly spaced subset of its encoder layers (`distill.depth`; every other one
at half depth, the last one always), optionally fewer FFN neurons per layer (`distill.ffn_width`, chosen and
least-squares repaired as `pipeline.surgery.prune` does). It is trained on the
teacher's soft predictions (KL at `distill.temperature`) plus, weighted by `distill.hard_label_weight`,
cross-entropy on the gold labels of the labelled training reviews. The unlabelled `transfer` reviews
(`data.transfer_reviews`) are labelled by the teacher alone: their split has no label column, and here they carry
`NO_LABEL`, which the loss ignores."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.io import write_json
from pipeline.core.params import DataParams, DistillParams, MlflowParams, Params, TrainParams, to_dict
from pipeline.training.curve_files import MetricSink, write_curves
from pipeline.training.fingerprint import fingerprint, training_trajectory

# Lightning, torch and the student's code are imported where a student is trained: a skipped student (the default)
# writes its records without them.
if TYPE_CHECKING:
    import torch

    from pipeline.core.machine import Choice
    from pipeline.core.params import ResolvedAuto
    from pipeline.core.parent_run import RunContext
    from pipeline.training.checkpoints import ResumePlan
    from pipeline.training.classifier import IMDBDataModule
    from pipeline.training.labelling import Labelling, TransferSet
    from pipeline.training.student_classifier import StudentClassifier

log = logging.getLogger(__name__)

#: The distill stage's record of a skipped or built student, beside the HF files.
STUDENT_RECORD = "pipeline.json"


@dataclass(frozen=True)
class DistillResult:
    """What the distill stage measured (empty when skipped)."""

    metrics: dict[str, Any]
    student_dir: Path
    status: str = "ok"
    reason: str = ""


def student_train_params(params: Params, precision: Choice) -> TrainParams:
    """`train` with the student's epochs, batch size and learning rate (one validation per epoch), in `precision`
    (`train.precision` as the stage resolved it): what the student trains with, and what its resume fingerprint
    holds, from this one place."""
    d = params.distill
    return dataclasses.replace(params.train, epochs=d.epochs, batch_size=d.batch_size, lr=d.lr,
                               precision=precision.value)


def distill(teacher_dir: Path, tokenized_dir: Path, student_dir: Path, metrics_path: Path, plots_dir: Path,
            params: Params, precision: Choice, metric_sink: MetricSink | None = None,
            enabled: Choice | None = None, plan: ResumePlan | None = None) -> DistillResult:
    """Build the student, label the reviews with the teacher, train, keep the best epoch by validation accuracy,
    score the test split and save the student in HF format with its record (the teacher's preprocessing, and the
    machine choices: `precision`, `train.precision` as the stage resolved it, and, from `run_distill`, how
    `distill.enabled` resolved). Training checkpoints and resumes as
    finetune's does (`train.checkpoint_dir/distill`, `plan` else `distill_plan`).

    Under DDP (`train.devices` > 1) Lightning starts the stage again for each further process, which labels the
    reviews itself (each rank trains on them) and trains its share; only rank 0 then restores the best epoch,
    scores, saves and clears the checkpoints: the others return once training ends, with empty metrics."""
    from pipeline.modeling import load_finetuned
    from pipeline.surgery.student import layer_list
    from pipeline.training.checkpoints import CheckpointStore
    from pipeline.training.loop import fit, predict_split, save_model, seed_run

    started = time.perf_counter()
    d = params.distill
    train = student_train_params(params, precision)
    log.info("distill: train.precision %s", precision.tag())
    seed_run(train)
    teacher, tokenizer, meta = load_finetuned(teacher_dir)
    reviews = label_reviews(teacher, tokenizer, meta, tokenized_dir, d, train, precision)
    student = student_model(teacher, reviews, params, train)
    plan = plan or distill_plan(teacher_dir, tokenized_dir, params, precision)
    store = CheckpointStore.for_job(params.train, "distill")
    fitted = fit(student.module, train, store=store, plan=plan, position=reviews.datamodule.position,
                 datamodule=reviews.datamodule, sink=metric_sink)
    if not fitted.trainer.is_global_zero:  # the best epoch is loaded, scored and saved by rank 0 alone
        return DistillResult({}, student_dir, "worker", "a training process of rank > 0: rank 0 saves the student")
    logits, labels = predict_split(student.module, reviews.datamodule, "test")
    curves, transfer = fitted.curves, reviews.transfer
    # Agreement with the teacher on the test split is the evaluate stage's `agreement_with_fp32`.
    metrics: dict[str, Any] = {
        "test_accuracy": float((logits.argmax(-1) == labels).mean()),
        "best_val_accuracy": fitted.best_score,
        "labelled_reviews": transfer.labelled, "transfer_reviews": transfer.unlabelled,
        "teacher_train_accuracy": reviews.teacher_train_accuracy,  # how often the soft targets agree with gold
        "teacher_labelling_seconds": round(reviews.seconds, 2),
        "teacher_labelling_device": reviews.labelling.device,
        "teacher_labelling_autocast": reviews.labelling.autocast or "none",
        "train_seconds": curves.train_seconds,
        "train_samples_per_s": curves.samples_per_s,
        "student_layers": len(student.kept), "teacher_layers": len(layer_list(teacher)[0]),
        **student.sizes(teacher),
        "wall_time_s": time.perf_counter() - started,
        "precision": precision.value,
        "train_attention": fitted.attention.value,  # the attention kernel it trained with (as finetune records it)
        "train_steps": fitted.steps,
        **plan.record(),  # resumed, resumed_from_step, resume_reason
        **({"enabled": enabled.to_dict()} if enabled else {}),  # as in the skip record: how the setting resolved
    }
    record = {"distillation": {"teacher": str(teacher_dir), "kept_layers": student.kept, **student.width,
                               **to_dict(d), "labelled_reviews": transfer.labelled,
                               "transfer_reviews": transfer.unlabelled}}
    save_model(student.module.model, tokenizer, student_dir, _teacher_data(meta, params, teacher_dir), params.model,
               train, choices=[precision, fitted.attention] + ([enabled] if enabled else []), extra=record)
    write_json(metrics_path, metrics)
    curves.write(plots_dir)
    store.clear()  # the student is saved: nothing left to resume
    log.info("student: %d of %d layers, test accuracy %.4f (best validation accuracy %.4f)",
             len(student.kept), metrics["teacher_layers"], metrics["test_accuracy"], metrics["best_val_accuracy"])
    return DistillResult(metrics, student_dir)


@dataclass(frozen=True)
class LabelledReviews:
    """The student's training data: the splits, with the training split replaced by every labelled and transfer
    review and the teacher's logits for each (`transfer`), and how the teacher labelled them."""

    datamodule: IMDBDataModule
    transfer: TransferSet
    labelling: Labelling
    pad: int  # the tokenizer's padding id
    seconds: float  # the teacher's labelling
    teacher_train_accuracy: float  # how often the teacher's label is the gold one, on the labelled reviews


def label_reviews(teacher: torch.nn.Module, tokenizer: Any, meta: dict[str, Any], tokenized_dir: Path,
                  d: DistillParams, train: TrainParams, precision: Choice) -> LabelledReviews:
    """The tokenized splits with the teacher's logits on every training and transfer review, each read as
    `d.teacher_reads` says, on the device and autocast the student trains with (`precision`)."""
    from pipeline.data.tokens import training_window
    from pipeline.modeling import pad_id
    from pipeline.training.classifier import IMDBDataModule
    from pipeline.training.labelling import labelling_setup, read_transfer_ids, transfer_set

    pad = pad_id(tokenizer)
    dm = IMDBDataModule(tokenized_dir, train, pad_id=pad)  # whole reviews: transfer_set windows the student's
    dm.setup("fit")
    labelling = labelling_setup(train, precision.value)
    log.info("distill: the teacher labels on %s (autocast %s), reading each review's %s", labelling.device,
             labelling.autocast or "none", "training window" if d.teacher_reads == "window" else "whole prepared text")
    labelled_at = time.perf_counter()
    transfer = transfer_set(teacher, dm.datasets["train"], read_transfer_ids(tokenized_dir),
                            window=training_window(meta, tokenizer), teacher_reads=d.teacher_reads,
                            batch_size=train.eval_batch_size, pad_id=pad, labelling=labelling)
    seconds = time.perf_counter() - labelled_at
    dm.datasets["train"] = transfer.dataset()  # setup() keeps a split it already has
    agreement = float((transfer.teacher_logits[: transfer.labelled].argmax(-1)
                       == transfer.labels[: transfer.labelled]).mean())
    return LabelledReviews(dm, transfer, labelling, pad, seconds, agreement)


@dataclass(frozen=True)
class Student:
    """The student cut from the teacher, in its Lightning module, with the teacher layers it kept and how its FFN
    was narrowed (empty: not narrowed)."""

    module: StudentClassifier
    kept: list[int]
    width: dict[str, Any]

    def sizes(self, teacher: torch.nn.Module) -> dict[str, int]:
        """The student's and the teacher's parameter counts, whole and encoder only."""
        from pipeline.surgery.student import count_parameters

        return {"student_parameters": count_parameters(self.module.model),
                "teacher_parameters": count_parameters(teacher),
                "student_encoder_parameters": count_parameters(self.module.model, encoder_only=True),
                "teacher_encoder_parameters": count_parameters(teacher, encoder_only=True)}


def student_model(teacher: torch.nn.Module, reviews: LabelledReviews, params: Params, train: TrainParams) -> Student:
    """The student: `distill.depth` of the teacher's layers, its FFN narrowed to `distill.ffn_width` on prune's
    calibration settings where set, in the module that trains it (the teacher kept beside it where the loss
    matches hidden states)."""
    from pipeline.surgery.student import build_student, narrow_ffn
    from pipeline.training.classifier import OptimisationRecipe
    from pipeline.training.student_classifier import StudentClassifier

    d = params.distill
    student, kept = build_student(teacher, d.depth)
    width: dict[str, Any] = {}
    if d.ffn_width is not None:
        student, width = narrow_ffn(student, reviews.datamodule.datasets["train"].input_ids, d.ffn_width,
                                    reviews.pad, calibration=params.prune, seed=train.seed)
    module = StudentClassifier(student, d, OptimisationRecipe.of(train, lr=d.lr),
                               teacher=teacher if d.hidden_weight > 0 else None, kept=kept)
    return Student(module, kept, width)


def distill_plan(teacher_dir: Path, tokenized_dir: Path, params: Params, precision: Choice) -> ResumePlan:
    """Whether distill resumes from `train.checkpoint_dir/distill`: its fingerprint is the student's and the
    trainer's settings (`precision`: `train.precision` as the stage resolved it), the teacher's files, the tokenized
    splits and the training code. The `export` settings are not in it: they shape the student's variants, built
    after training, never its weights."""
    from pipeline.training.checkpoints import CheckpointStore

    train = student_train_params(params, precision)
    p = params.prune  # the FFN narrowing's calibration (`narrow_ffn`)
    settings = {"distill": to_dict(params.distill), "train": training_trajectory(train),
                "data": to_dict(params.data), "ffn_calibration": [p.calibration_samples, p.calibration_batch_size,
                                                                   p.damp]}
    inputs = [teacher_dir, tokenized_dir]
    return CheckpointStore.for_job(params.train, "distill").plan(fingerprint(settings, inputs), params.train.resume)


def _teacher_data(meta: dict[str, Any], params: Params, teacher_dir: Path) -> DataParams:
    """The data params the teacher was trained with (its record, `teacher_dir/pipeline.json`), so the student's
    record states the same preprocessing as the teacher's. A record this code cannot read is the teacher's fault,
    not params.yaml's, and the error says so."""
    from pipeline.core.params import ParamsError, from_mapping
    from pipeline.surgery.errors import DistillError

    recorded = meta.get("params", {}).get("data")
    if not recorded:
        return params.data
    try:
        return from_mapping(DataParams, recorded, "params.data")
    except ParamsError as exc:
        raise DistillError(f"the teacher's record {teacher_dir / 'pipeline.json'} (not params.yaml): {exc}; "
                           "finetune the teacher again with this code (dvc repro finetune)") from None


def write_skipped(student_dir: Path, metrics_path: Path, plots_dir: Path, reason: str,
                  enabled: Choice | None = None) -> DistillResult:
    """The stage's outputs when the student is off: a record that says why (and how `distill.enabled` resolved),
    metrics that say skipped, and empty curves."""
    from pipeline.core.io import directory_replaced_on_success

    write_curves(plots_dir)
    record = {"status": "skipped", "reason": reason} | ({"enabled": enabled.to_dict()} if enabled else {})
    # the record alone replaces the directory: no weights of an earlier student stay beside "skipped"
    with directory_replaced_on_success(student_dir, complete_when=STUDENT_RECORD) as work:
        write_json(work / STUDENT_RECORD, record)
    write_json(metrics_path, record)
    return DistillResult({}, student_dir, "skipped", reason)


def run_distill(*, teacher_dir: Path, tokenized_dir: Path, student_dir: Path, metrics_path: Path, plots_dir: Path,
                params: Params, auto: ResolvedAuto, run_context: RunContext | None,
                build_variants: Callable[[], Mapping[str, Any]]) -> DistillResult:
    """`distill` inside an MLflow child run of the execution's parent (`run_context`) like finetune's (machine
    load sampled, curves, metrics, the student's files), then `build_variants` (the student's exports) in the
    same run, its report logged like other build stages'. A disabled student is recorded as skipped with the
    reason, and so are its variants. `auto`: the stage's resolved `auto` settings (`train.precision`,
    `distill.enabled`).

    Under multi-process DDP, Lightning starts the stage again for each process of rank > 0: such a process (its
    stage passes no context, None) trains its share and does nothing else, no MLflow run, no variants, and `distill`
    leaves the records to rank 0. A run stopped by a signal (checkpoint written, to be resumed) ends KILLED
    (`stage_run`)."""
    from pipeline.core.tracking import stage_run
    from pipeline.training.elastic import is_rank_zero

    tracking: MlflowParams = params.mlflow
    train = params.train
    precision, enabled = auto.precision, auto.distill
    reason = ("distill.enabled is false (make run PROFILE=full or PROFILE=avx2-student builds the student)"
              if enabled.asked is False
              else f"distill.enabled auto resolved to false: {enabled.reason}")
    if run_context is None or not is_rank_zero():  # rank zero logs and builds for the group
        if enabled.value:
            return distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params, precision,
                           enabled=enabled)
        return write_skipped(student_dir, metrics_path, plots_dir, reason, enabled)  # no student: a single process

    log.info("distill: distill.enabled %s", enabled.tag())
    with stage_run(run_context, "distill", system_metrics=tracking.system_metrics) as run:
        run.log_sections({"distill": to_dict(params.distill), "train": to_dict(train),
                          "export": to_dict(params.export), "quantize": to_dict(params.quantize)})
        run.set_tags({"distill.enabled.resolved": enabled.tag()})
        if enabled.value:
            from pipeline.training.checkpoints import CheckpointStore, start_attempt

            plan = distill_plan(teacher_dir, tokenized_dir, params, precision)
            start_attempt(run, plan, CheckpointStore.for_job(train, "distill"))
            result = distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params, precision,
                             metric_sink=run.log_steps, enabled=enabled, plan=plan)
            run.log_metrics(result.metrics)
            run.set_tags({"status": "ok", "train.precision.resolved": result.metrics["precision"],
                          "teacher_labelling": f"{result.metrics['teacher_labelling_device']}, autocast "
                                               f"{result.metrics['teacher_labelling_autocast']}"})
            run.log_artifacts(plots_dir, "curves")
            run.log_artifacts(student_dir, "model")
        else:
            log.warning("student skipped: %s", reason)
            run.set_tags({"status": "skipped", "reason": reason})
            result = write_skipped(student_dir, metrics_path, plots_dir, reason, enabled)
        run.log_report(build_variants(), [metrics_path])
    return result

