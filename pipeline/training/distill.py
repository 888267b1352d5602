"""The `distill` stage's training: a shallower student initialised from the finetuned teacher and trained to
imitate it.

The recipe is DistilBERT's (Sanh et al., 2019), for a finetuned classifier: the student keeps the teacher's
embeddings, classifier head and an evenly spaced subset of its encoder layers (`distill.depth`; every other one
at half depth, the last one always), optionally fewer FFN neurons per layer (`distill.ffn_width`, chosen and
least-squares repaired as `pipeline.variants.prune` does). It is trained on the
teacher's soft predictions (KL at `distill.temperature`) plus, weighted by `distill.hard_label_weight`,
cross-entropy on the gold labels of the labelled training reviews. The unlabelled `transfer` reviews
(`data.transfer_reviews`) are labelled by the teacher alone: their split has no label column, and here they carry
`NO_LABEL`, which the loss ignores."""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import torch

from pipeline.core.io import write_json
from pipeline.core.params import TEACHER_READS, DistillParams, MlflowParams, Params, TrainParams, to_dict
from pipeline.data.batching import NO_LABEL, TokenizedDataset
from pipeline.data.imdb import TRANSFER
from pipeline.training.classifier import (
    CurveRecorder,
    IMDBDataModule,
    MetricSink,
    SentimentClassifier,
    build_trainer,
)
from pipeline.training.finetune import predict_split, save_model, write_curves
from pipeline.training.resume import CheckpointStore, ResumePlan, fingerprint, trajectory_settings

if TYPE_CHECKING:
    from pipeline.core.machine import Choice

log = logging.getLogger(__name__)

#: The distill stage's record of a skipped or built student, beside the HF files.
STUDENT_RECORD = "pipeline.json"


class DistillError(RuntimeError):
    """A teacher or setting the student cannot be built from."""


# ------------------------------------------------------------------------------------------ the student
#: (attribute path of the encoder's layer list, config key of the layer count) per architecture family.
_LAYER_LISTS = (("bert.encoder.layer", "num_hidden_layers"), ("distilbert.transformer.layer", "n_layers"),
                ("roberta.encoder.layer", "num_hidden_layers"))


def _find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList, str]:
    """Where the encoder keeps its layers: attribute path, the layer list and the config key that counts them."""
    for path, key in _LAYER_LISTS:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, torch.nn.ModuleList):
            return path, layers, key
    raise DistillError(f"{type(model).__name__}: no encoder layer list at any of {[p for p, _ in _LAYER_LISTS]}")


def layer_list(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, str]:
    """The encoder's list of layers and the config key that counts them."""
    _, layers, key = _find_layers(model)
    return layers, key


def kept_layers(teacher_depth: int, depth: int) -> list[int]:
    """Indices of the teacher layers the student keeps: evenly spaced, the last one always (it feeds the head).

    6 -> 3 keeps 1, 3, 5 (every other layer, as DistilBERT took from BERT); depth >= teacher_depth keeps all."""
    if depth >= teacher_depth:
        return list(range(teacher_depth))
    return [round((i + 1) * teacher_depth / depth) - 1 for i in range(depth)]


def build_student(teacher: torch.nn.Module, depth: int) -> tuple[torch.nn.Module, list[int]]:
    """A copy of `teacher` with only `kept_layers(...)` of its encoder layers (weights copied, config updated)."""
    student = copy.deepcopy(teacher)
    path, layers, key = _find_layers(student)
    keep = kept_layers(len(layers), depth)
    kept = torch.nn.ModuleList([layers[i] for i in keep])
    parent_path, _, name = path.rpartition(".")
    setattr(student.get_submodule(parent_path), name, kept)
    setattr(student.config, key, len(keep))
    for i, layer in enumerate(kept):  # attention modules that index a KV cache by layer number
        attention = getattr(getattr(layer, "attention", None), "self", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = i
    return student, keep


def count_parameters(model: torch.nn.Module, encoder_only: bool = False) -> int:
    if encoder_only:
        layers, _ = layer_list(model)
        return sum(p.numel() for p in layers.parameters())
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ the loss
def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      kl_weight: float, temperature: float = 1.0) -> torch.Tensor:
    """`kl_weight` x T^2 x KL(teacher_T || student_T) + (1 - kl_weight) x cross-entropy on the known labels.

    Softening both distributions by `temperature` T shows the student how sure the teacher is, and T^2 keeps the
    KL gradients on the scale of the cross-entropy's (Hinton et al., 2015). Labels equal to `NO_LABEL` (the
    teacher-labelled transfer reviews) contribute to the KL term only; a batch without any known label has no
    cross-entropy term."""
    logits = logits.float()
    known = labels != NO_LABEL
    ce = (torch.nn.functional.cross_entropy(logits[known], labels[known]) if bool(known.any())
          else logits.new_zeros(()))
    if kl_weight == 0.0:
        return ce
    student = torch.log_softmax(logits / temperature, -1)
    teacher = torch.log_softmax(teacher_logits.float() / temperature, -1)
    kl = torch.nn.functional.kl_div(student, teacher, reduction="batchmean", log_target=True)
    return kl_weight * temperature**2 * kl + (1.0 - kl_weight) * ce


def hidden_state_loss(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...],
                      kept: list[int], mask: torch.Tensor) -> torch.Tensor:
    """Mean squared distance between each student layer's output and the output of the teacher layer it was
    copied from (`kept`), over the real (unpadded) tokens, averaged over layers.

    `*_hidden` are HF `hidden_states` (embeddings first, then one entry per layer), so student layer i is entry
    i + 1 and its teacher layer entry kept[i] + 1. TinyBERT-style layer matching: the student keeps imitating
    what its layers computed in the teacher, not only the teacher's final prediction."""
    weights = mask.unsqueeze(-1).float()
    tokens = weights.sum().clamp(min=1.0) * student_hidden[-1].shape[-1]
    per_layer = [(((s.float() - teacher_hidden[k + 1].float()) ** 2) * weights).sum() / tokens
                 for s, k in zip(student_hidden[1:], kept, strict=True)]
    return torch.stack(per_layer).mean()


class StudentClassifier(SentimentClassifier):
    """`SentimentClassifier` trained on the teacher's logits in each batch (`teacher_logits`) and, with
    `distill.hidden_weight` > 0, on the teacher's hidden states (the teacher runs alongside, frozen)."""

    def __init__(self, model: torch.nn.Module, params: DistillParams, weight_decay: float, warmup_ratio: float,
                 teacher: torch.nn.Module | None = None, kept: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(model, params.lr, weight_decay, warmup_ratio, **kwargs)
        self.kl_weight = 1.0 - params.hard_label_weight
        self.temperature = params.temperature
        self.hidden_weight = params.hidden_weight
        if self.hidden_weight > 0 and (teacher is None or kept is None):
            raise DistillError("distill.hidden_weight > 0 needs the teacher and the kept layer indices")
        # a plain attribute, not a submodule: the teacher is neither trained nor saved with the student
        object.__setattr__(self, "_teacher", None if teacher is None else teacher.eval().requires_grad_(False))
        self.kept = kept or []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.hidden_weight > 0:
            out = self._fn()(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            logits = out.logits
            teacher = self._teacher.to(ids.device)
            with torch.no_grad():
                reference = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            hidden = hidden_state_loss(out.hidden_states, reference, self.kept, mask)
            self.log("hidden_loss", hidden, batch_size=len(ids))
        else:
            logits, hidden = self(ids, mask), None
        loss = distillation_loss(logits, batch["teacher_logits"], batch["labels"], self.kl_weight, self.temperature)
        if hidden is not None:
            loss = loss + self.hidden_weight * hidden
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss


# ------------------------------------------------------------------------------------------ the data
@dataclass(frozen=True)
class TransferSet:
    """Training reviews for the student: token ids, gold labels (`NO_LABEL` for transfer reviews) and the
    teacher's logits for every one of them."""

    input_ids: list[np.ndarray]
    labels: np.ndarray
    teacher_logits: np.ndarray
    labelled: int
    unlabelled: int

    def dataset(self) -> TokenizedDataset:
        """The student's training split: every review with its label and the teacher's logits."""
        return TokenizedDataset(self.input_ids, self.labels, self.teacher_logits)


def read_transfer_ids(tokenized_dir: Path) -> list[np.ndarray]:
    """Token ids of the unlabelled transfer split (none when prepare wrote none); its label column is never read,
    and a split that has one is refused."""
    from pipeline.data.tokens import read_tokenized

    if not (tokenized_dir / f"{TRANSFER}.parquet").is_file():
        return []
    frame = read_tokenized(tokenized_dir, TRANSFER)
    if "label" in frame.columns:
        raise DistillError(f"{tokenized_dir / TRANSFER}.parquet has a label column; the transfer split must be "
                           "unlabelled (re-run `dvc repro prepare`)")
    return frame["input_ids"].tolist()


@dataclass(frozen=True)
class Labelling:
    """Where and how the teacher labels the reviews."""

    device: str  # the device the student trains on: "cuda" where training uses the GPU, else "cpu"
    autocast: str | None  # `TorchRunner` autocast: what the resolved training precision runs in, None for fp32


def labelling_setup(train: TrainParams, precision: str, cuda: bool | None = None) -> Labelling:
    """The teacher labels on the device the student trains on, in the training precision `precision` (resolved,
    not `auto`): bf16 autocast for bf16-mixed (resolved so only where bf16 is native), fp16 autocast for 16-mixed
    on CUDA, fp32 otherwise."""
    from pipeline.core.machine import trains_on_cuda

    on_gpu = trains_on_cuda(train.accelerator, cuda)
    autocast = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") and on_gpu else None
    return Labelling("cuda" if on_gpu else "cpu", autocast)


def teacher_logits(teacher: torch.nn.Module, seqs: list[np.ndarray], batch_size: int, pad_id: int,
                   labelling: Labelling) -> np.ndarray:
    """The teacher's logits per review (its predictions are the student's targets), computed on
    `labelling.device`; the teacher is back on the CPU afterwards, where the student is built from it."""
    from pipeline.variants.runners import predict_logits_on

    return predict_logits_on(teacher.eval(), labelling.device, seqs, batch_size, pad_id, labelling.autocast,
                             progress="teacher labels")


def transfer_set(teacher: torch.nn.Module, labelled: TokenizedDataset, transfer_ids: list[np.ndarray],
                 window: Callable[[np.ndarray], np.ndarray] | None, teacher_reads: str, batch_size: int, pad_id: int,
                 labelling: Labelling) -> TransferSet:
    """The labelled training reviews and the transfer reviews (`NO_LABEL`), each in the student's training window,
    with the teacher's logits. `labelled` holds whole prepared reviews; the teacher reads each in the training
    window (`teacher_reads: window`) or whole (`review`: its prediction from more of the text is the target for
    what the student sees)."""
    if teacher_reads not in TEACHER_READS:
        raise DistillError(f"distill.teacher_reads must be one of {TEACHER_READS}, not {teacher_reads!r}")
    reviews = [*labelled.input_ids, *transfer_ids]
    seqs = [window(ids) for ids in reviews] if window is not None else reviews
    labels = np.concatenate([labelled.labels, np.full(len(transfer_ids), NO_LABEL, dtype=np.int64)])
    logits = teacher_logits(teacher, reviews if teacher_reads == "review" else seqs, batch_size, pad_id, labelling)
    return TransferSet(seqs, labels, logits, len(labelled.labels), len(transfer_ids))


# ------------------------------------------------------------------------------------------ the stage's work
@dataclass(frozen=True)
class DistillResult:
    """What the distill stage measured (empty when skipped)."""

    metrics: dict[str, Any]
    student_dir: Path
    status: str = "ok"
    reason: str = ""


def student_train_params(params: Params) -> TrainParams:
    """`train` with the student's epochs, batch size and learning rate (one validation per epoch)."""
    d = params.distill
    return dataclasses.replace(params.train, epochs=d.epochs, batch_size=d.batch_size, lr=d.lr)


def distill(teacher_dir: Path, tokenized_dir: Path, student_dir: Path, metrics_path: Path, plots_dir: Path,
            params: Params, metric_sink: MetricSink | None = None, enabled: Choice | None = None,
            precision: Choice | None = None, plan: ResumePlan | None = None) -> DistillResult:
    """Build the student, label the reviews with the teacher, train, keep the best epoch by validation accuracy,
    score the test split and save the student in HF format with its record (the teacher's preprocessing, and the
    machine choices: the precision and, from `run_distill`, how `distill.enabled` resolved; `precision` is
    `train.precision` as the caller resolved it, else it is resolved here). Training checkpoints and resumes as
    finetune's does (`train.checkpoint_dir/distill`, `plan` else `distill_plan`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pipeline.core.machine import resolve_precision
    from pipeline.data.tokens import training_window
    from pipeline.modeling import load_finetuned, pad_id

    started = time.perf_counter()
    d = params.distill
    choice = precision or resolve_precision(params.train.precision, params.train.accelerator)
    train = dataclasses.replace(student_train_params(params), precision=choice.value)
    log.info("distill: train.precision %s", choice.tag())
    if train.threads:
        torch.set_num_threads(train.threads)
    L.seed_everything(train.seed, workers=True, verbose=False)
    teacher, tokenizer, meta = load_finetuned(teacher_dir)
    pad = pad_id(tokenizer)
    window = training_window(meta, tokenizer)
    dm = IMDBDataModule(tokenized_dir, train, pad_id=pad)  # whole reviews: transfer_set windows the student's
    dm.setup("fit")
    labelling = labelling_setup(train, choice.value)
    log.info("distill: the teacher labels on %s (autocast %s), reading each review's %s", labelling.device,
             labelling.autocast or "none", "training window" if d.teacher_reads == "window" else "whole prepared text")
    labelled_at = time.perf_counter()
    transfer = transfer_set(teacher, dm.datasets["train"], read_transfer_ids(tokenized_dir), window, d.teacher_reads,
                            train.eval_batch_size, pad, labelling)
    labelling_seconds = time.perf_counter() - labelled_at
    dm.datasets["train"] = transfer.dataset()  # setup() keeps a split it already has
    teacher_train_accuracy = float((transfer.teacher_logits[: transfer.labelled].argmax(-1)
                                     == transfer.labels[: transfer.labelled]).mean())

    student, keep = build_student(teacher, d.depth)
    width: dict[str, Any] = {}
    if d.ffn_width is not None:
        student, width = narrow_ffn(student, dm.datasets["train"].input_ids, d.ffn_width, pad)
    module = StudentClassifier(student, d, train.weight_decay, train.warmup_ratio,
                               teacher=teacher if d.hidden_weight > 0 else None, kept=keep, compile_model=train.compile,
                               compile_mode=train.compile_mode, fused_optimizer=train.fused_optimizer)
    recorder = CurveRecorder(sink=metric_sink)
    plan = plan or distill_plan(teacher_dir, tokenized_dir, params)
    store = CheckpointStore.for_job(params.train, "distill")
    with tempfile.TemporaryDirectory(prefix="distill-") as tmp:
        ckpt = ModelCheckpoint(dirpath=str(store.best_dir), monitor="val_acc", mode="max", save_top_k=1,
                               filename="best-{step}-{val_acc:.4f}", enable_version_counter=False)
        trainer = build_trainer(train, Path(tmp), [ckpt, recorder, *store.callbacks(dm.position)])
        trainer.fit(module, datamodule=dm, ckpt_path=plan.ckpt_path)
        if ckpt.best_model_path:  # the best epoch by validation accuracy, not the last
            state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
            module.load_state_dict(state)
        logits, labels = predict_split(module, dm, "test")
    # Agreement with the teacher on the test split is the evaluate stage's `agreement_with_fp32`.
    metrics: dict[str, Any] = {
        "test_accuracy": float((logits.argmax(-1) == labels).mean()),
        "best_val_accuracy": float(ckpt.best_model_score) if ckpt.best_model_score is not None else float("nan"),
        "labelled_reviews": transfer.labelled, "transfer_reviews": transfer.unlabelled,
        "teacher_train_accuracy": teacher_train_accuracy,  # how often the soft targets agree with gold labels
        "teacher_labelling_seconds": round(labelling_seconds, 2),
        "teacher_labelling_device": labelling.device, "teacher_labelling_autocast": labelling.autocast or "none",
        "train_seconds": recorder.train_seconds,
        "train_samples_per_s": recorder.samples / recorder.train_seconds if recorder.train_seconds else 0.0,
        "student_layers": len(keep), "teacher_layers": len(layer_list(teacher)[0]),
        "student_parameters": count_parameters(module.model),
        "teacher_parameters": count_parameters(teacher),
        "student_encoder_parameters": count_parameters(module.model, encoder_only=True),
        "teacher_encoder_parameters": count_parameters(teacher, encoder_only=True),
        "wall_time_s": time.perf_counter() - started,
        "precision": choice.value,
        "train_steps": trainer.global_step,
        **plan.record(),  # resumed, resumed_from_step, resume_reason
        **({"enabled": enabled.to_dict()} if enabled else {}),  # as in the skip record: how the setting resolved
    }
    record = {"distillation": {"teacher": str(teacher_dir), "kept_layers": keep, **width, **to_dict(d),
                               "labelled_reviews": transfer.labelled, "transfer_reviews": transfer.unlabelled}}
    save_model(module.model, tokenizer, student_dir, _teacher_data(meta, params), params.model, train,
               choices=[choice] + ([enabled] if enabled else []), extra=record)
    write_json(metrics_path, metrics)
    write_curves(plots_dir, recorder)
    store.clear()  # the student is saved: nothing left to resume
    log.info("student: %d of %d layers, test accuracy %.4f (best validation accuracy %.4f)",
             len(keep), metrics["teacher_layers"], metrics["test_accuracy"], metrics["best_val_accuracy"])
    return DistillResult(metrics, student_dir)


def distill_plan(teacher_dir: Path, tokenized_dir: Path, params: Params) -> ResumePlan:
    """Whether distill resumes from `train.checkpoint_dir/distill`: its fingerprint is the student's and the
    trainer's settings, the teacher's files, the tokenized splits and the training code."""
    from pipeline.core.machine import resolve_precision

    train = student_train_params(params)
    train = dataclasses.replace(train, precision=resolve_precision(train.precision, train.accelerator).value)
    settings = {"distill": to_dict(params.distill), "train": trajectory_settings(to_dict(train)),
                "export": to_dict(params.export), "data": to_dict(params.data)}
    inputs = [teacher_dir, tokenized_dir]
    return CheckpointStore.for_job(params.train, "distill").plan(fingerprint(settings, inputs), params.train.resume)


def _teacher_data(meta: dict[str, Any], params: Params) -> Any:
    """The data params the teacher was trained with (its record), so the student's record states the same
    preprocessing as the teacher's."""
    from pipeline.core.params import DataParams, from_mapping

    recorded = meta.get("params", {}).get("data")
    return from_mapping(DataParams, recorded, "data") if recorded else params.data


def narrow_ffn(student: torch.nn.Module, reviews: list[np.ndarray], ffn_width: int,
               pad: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The student with `ffn_width` FFN neurons per layer, chosen and least-squares repaired on 256 training
    reviews as `prune` does (`prune_encoder`); its config's `intermediate_size` follows, so it saves and loads as
    an ordinary HF model. Heads are not narrowed: a BERT config cannot state fewer heads of the same size."""
    from pipeline.variants.prune import calibration_batches, prune_encoder

    narrowed, report = prune_encoder(student, calibration_batches(reviews[:256], 16, pad), None, ffn_width)
    return narrowed, {"ffn_width": report["ffn_width"], "teacher_ffn_width": report["original_ffn_width"],
                      "ffn_rel_error": report["ffn_rel_error"]}


def write_skipped(student_dir: Path, metrics_path: Path, plots_dir: Path, reason: str,
                  enabled: Choice | None = None) -> DistillResult:
    """The stage's outputs when the student is off: a record that says why (and how `distill.enabled` resolved),
    metrics that say skipped, and empty curves."""
    student_dir.mkdir(parents=True, exist_ok=True)
    write_curves(plots_dir, CurveRecorder())
    record = {"status": "skipped", "reason": reason} | ({"enabled": enabled.to_dict()} if enabled else {})
    write_json(student_dir / STUDENT_RECORD, record)
    write_json(metrics_path, record)
    return DistillResult({}, student_dir, "skipped", reason)


def run_distill(teacher_dir: Path, tokenized_dir: Path, student_dir: Path, metrics_path: Path, plots_dir: Path,
                params: Params, build_variants: Callable[[], Mapping[str, Any]]) -> DistillResult:
    """`distill` inside an MLflow child run like finetune's (machine load sampled, curves, metrics, the student's
    files), then `build_variants` (the student's exports) in the same run, its report logged like other build
    stages'. A disabled student is recorded as skipped with the reason, and so are its variants."""
    from pipeline.core.machine import resolve_distill, resolve_precision
    from pipeline.core.tracking import stage_run

    tracking: MlflowParams = params.mlflow
    train = params.train
    precision = resolve_precision(train.precision, train.accelerator)
    enabled = resolve_distill(params.distill.enabled, train.accelerator, precision.value)
    log.info("distill: distill.enabled %s", enabled.tag())
    with stage_run(tracking, "distill", system_metrics=tracking.system_metrics) as run:
        run.log_sections({"distill": to_dict(params.distill), "train": to_dict(train),
                          "export": to_dict(params.export), "quantize": to_dict(params.quantize)})
        run.set_tags({"distill.enabled.resolved": enabled.tag()})
        if enabled.value:
            from pipeline.training.finetune import start_attempt

            plan = distill_plan(teacher_dir, tokenized_dir, params)
            start_attempt(run, plan, CheckpointStore.for_job(train, "distill"))
            result = distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params,
                             metric_sink=run.log_steps, enabled=enabled, precision=precision, plan=plan)
            run.log_metrics(result.metrics)
            run.set_tags({"status": "ok", "train.precision.resolved": result.metrics["precision"],
                          "teacher_labelling": f"{result.metrics['teacher_labelling_device']}, autocast "
                                               f"{result.metrics['teacher_labelling_autocast']}"})
            run.log_artifacts(plots_dir, "curves")
            run.log_artifacts(student_dir, "model")
        else:
            reason = ("distill.enabled is false (make run PROFILE=full or PROFILE=avx2-student builds the student)"
                      if enabled.asked is False
                      else f"distill.enabled auto resolved to false: {enabled.reason}")
            log.warning("student skipped: %s", reason)
            run.set_tags({"status": "skipped", "reason": reason})
            result = write_skipped(student_dir, metrics_path, plots_dir, reason, enabled)
        run.log_report(build_variants(), [metrics_path])
    return result
