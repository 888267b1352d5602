"""The one training loop of finetune, distill and QAT: the Trainer factory (`build_trainer`), the run's threads and
seed (`seed_run`), the fit that resumes, checkpoints and restores the best weights (`fit`), and what follows a fit
(`predict_split`, `save_model`).

Every job fits the same way: the curves (`CurveRecorder`), the job's resumable checkpoints and signal handling
(`CheckpointStore.callbacks`), and, where it validates, the best checkpoint by validation accuracy, which is
loaded back into the module once training ends (the best epoch, not the last)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeline.core.io import write_json
from pipeline.core.params import DataParams, ModelParams, TrainParams, to_dict
from pipeline.core.third_party_output import lightning_lines_once
from pipeline.data.batching import LoaderPosition
from pipeline.training.checkpoints import AtomicCheckpointIO, CheckpointStore, ResumePlan
from pipeline.training.curve_files import MetricSink
from pipeline.training.curves import CurveRecorder

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from pipeline.core.machine import Choice
    from pipeline.training.classifier import IMDBDataModule


def build_trainer(params: TrainParams, work_dir: Path, callbacks: list[L.Callback], logger: Any = False,
                  profiler_dir: Path | None = None, enable_progress_bar: bool = True, validate: bool = True,
                  model_summary: bool = True) -> L.Trainer:
    """A Trainer configured from params; profiler traces go to `profiler_dir` when enabled. `validate` False runs no
    validation loop (a job without a validation split, QAT). Lightning's own checkpointing is on only where the
    callbacks hold a `ModelCheckpoint`: its default one would write a checkpoint nobody reads into `work_dir`."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    if params.precision == "auto":  # Lightning would refuse it with no hint of where it comes from
        raise ValueError("train.precision is still `auto`: resolve it for this machine first "
                         "(pipeline.core.params.resolve_auto(...).apply, as each stage does)")
    profiler: Any = None
    if params.profiler:
        from lightning.pytorch.profilers import PyTorchProfiler

        if profiler_dir is None:
            raise ValueError("train.profiler needs a profiler output directory")
        profiler_dir.mkdir(parents=True, exist_ok=True)
        profiler = PyTorchProfiler(
            dirpath=str(profiler_dir), filename="trace", export_to_chrome=True,
            schedule=torch.profiler.schedule(wait=2, warmup=2, active=5, repeat=1),
        )
    accelerator = "gpu" if params.accelerator == "cuda" else params.accelerator
    strategy: Any = params.strategy
    devices, num_nodes = params.devices, params.num_nodes
    elastic = elastic_world()
    if elastic is not None:  # under torchrun the group's shape is the rendezvous's, which may vary between restarts
        devices, num_nodes = elastic
        strategy = "ddp" if strategy == "auto" else strategy
    if strategy in ("ddp", "ddp_spawn") and not torch.cuda.is_available():
        from lightning.pytorch.strategies import DDPStrategy

        # gloo is the CPU backend; NCCL is picked automatically on CUDA.
        strategy = DDPStrategy(process_group_backend="gloo",
                               start_method="spawn" if params.strategy == "ddp_spawn" else "popen")
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    if enable_progress_bar:  # tqdm also reports when stderr is a log file, unlike the rich bar
        callbacks = [*callbacks, TQDMProgressBar(refresh_rate=10)]
    lightning_lines_once()
    return L.Trainer(
        max_epochs=params.epochs, accelerator=accelerator, devices=devices, num_nodes=num_nodes,
        strategy=strategy, precision=params.precision, accumulate_grad_batches=params.grad_accum,
        val_check_interval=1.0 / params.val_checks_per_epoch, num_sanity_val_steps=0,
        limit_val_batches=None if validate else 0, enable_checkpointing=checkpointing,
        enable_model_summary=model_summary,
        default_root_dir=str(work_dir), callbacks=callbacks, logger=logger, profiler=profiler,
        enable_progress_bar=enable_progress_bar, use_distributed_sampler=False, log_every_n_steps=10,
        deterministic=False, plugins=[AtomicCheckpointIO()],
    )


def elastic_world() -> tuple[int, int] | None:
    """(processes per machine, machines) when this process is a torchelastic worker (`torchrun`), else None."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    if not TorchElasticEnvironment.detect():
        return None
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return local, max(int(os.environ["WORLD_SIZE"]) // local, 1)


def seed_run(params: TrainParams) -> None:
    """The job's intra-op threads (`train.threads`, if set) and every RNG seeded from `train.seed`; called before
    anything draws random numbers (the classifier head's initialisation, dropout)."""
    if params.threads:
        torch.set_num_threads(params.threads)
    L.seed_everything(params.seed, workers=True, verbose=False)


@dataclass(frozen=True)
class Fitted:
    """What a fit left: its Trainer, its curves, and the best checkpoint by validation accuracy (its path, "" when
    the job does not validate, and its score, NaN then)."""

    trainer: L.Trainer
    curves: CurveRecorder
    best_checkpoint: str
    best_score: float
    attention: Choice  # the attention kernel it trained with (`machine.training_attention`)

    @property
    def steps(self) -> int:
        """Optimizer steps over the whole run (a resumed run's include the interrupted attempts')."""
        return int(self.trainer.global_step)


def best_checkpoint(directory: Path) -> ModelCheckpoint:
    """The best checkpoint by validation accuracy, ties to the lower validation loss (`BestByAccuracy`), saved as
    soon as each validation ends (Lightning's default for one validation an epoch is the epoch's end), so every
    resume point written after a validation (`resume.PeriodicCheckpoint`, a stop signal's) holds its score: a run
    resumed there, which does not validate again, never keeps a later, worse epoch as its best."""
    return BestByAccuracy(dirpath=str(directory), monitor="val_acc", mode="max", save_top_k=1,
                          filename="best-{step}-{val_acc:.4f}", enable_version_counter=False,
                          save_on_train_epoch_end=False)


class BestByAccuracy(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` keeping the one best checkpoint by `val_acc`, whose ties go to the lower
    `val_loss`. Lightning keeps the first of equal scores, and accuracy on a few hundred validation reviews moves in
    whole reviews: two epochs that score the same are common, and the first epoch's weights, with the higher loss,
    were kept (docs/training.md). Its state (with the tie's loss) is filed under Lightning's own key, so a
    checkpoint written before this class resumes into it (holding no loss, its first tie goes to the new weights)."""

    TIE_BREAK = "val_loss"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.best_tie_score: float | None = None

    @property
    def state_key(self) -> str:
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def check_monitor_top_k(self, trainer: L.Trainer, current: torch.Tensor | None = None) -> bool:
        loss = trainer.callback_metrics.get(self.TIE_BREAK)
        better = super().check_monitor_top_k(trainer, current)
        if not better and current is not None and loss is not None and self.best_model_score is not None:
            tied = bool(torch.eq(current.cpu(), self.best_model_score.cpu()))
            lower = self.best_tie_score is None or float(loss) < self.best_tie_score
            better = trainer.strategy.reduce_boolean_decision(tied and lower)
        if better and loss is not None:
            self.best_tie_score = float(loss)
        return bool(better)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_tie_score": self.best_tie_score}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_tie_score = state_dict.get("best_tie_score")
        if self.best_model_path and not Path(self.best_model_path).is_file():
            # the resume point predates a better checkpoint that replaced (deleted) the one it names: loading that
            # path when training ends would fail on every rerun. The resumed run keeps the best of its own
            # validations instead (its last weights where none follows).
            logging.getLogger(__name__).warning(
                "the best checkpoint this resume point names, %s, is gone (replaced by a later one before the run "
                "stopped): its best-so-far is dropped, the resumed run keeps the best of its own validations",
                self.best_model_path)
            self.best_model_path, self.best_model_score, self.best_tie_score = "", None, None
            self.best_k_models, self.kth_best_model_path = {}, ""
            self.kth_value = torch.tensor(-torch.inf if self.mode == "max" else torch.inf)


def fit(module: L.LightningModule, params: TrainParams, *, store: CheckpointStore | None, plan: ResumePlan | None,
        position: LoaderPosition, datamodule: IMDBDataModule | None = None, loader: DataLoader | None = None,
        sink: MetricSink | None = None, keep_best: bool = True, profiler_dir: Path | None = None,
        model_summary: bool = True) -> Fitted:
    """Train `module` on `datamodule` (or on the training `loader` alone), resuming from `plan`'s checkpoint.

    With `store`, checkpoints go to the job's directory periodically and when a stop signal arrives (and the
    training `position` in the epoch with them). `keep_best` validates and keeps the best checkpoint by validation
    accuracy in the store's `best/`, and loads it back into `module` on rank 0 once training ends; without it the
    job runs no validation and keeps its last weights (QAT). `sink` receives the curves' points (MLflow)."""
    curves = CurveRecorder(sink=sink)
    callbacks: list[L.Callback] = [curves, *(store.callbacks(position) if store is not None else [])]
    best: ModelCheckpoint | None = None
    if keep_best:
        if store is None:
            raise ValueError("keeping the best checkpoint needs the job's CheckpointStore")
        best = best_checkpoint(store.best_dir)
        callbacks.insert(0, best)
    from pipeline.core.machine import training_attention

    attention = training_attention(params.precision, params.accelerator)
    with tempfile.TemporaryDirectory(prefix="fit-") as tmp, attention_while_training(module, attention):
        trainer = build_trainer(params, Path(tmp), callbacks, profiler_dir=profiler_dir, validate=keep_best,
                                model_summary=model_summary)
        trainer.fit(module, datamodule=datamodule, train_dataloaders=loader,
                    ckpt_path=plan.ckpt_path if plan is not None else None)
    path = best.best_model_path if best is not None else ""
    if path and trainer.is_global_zero:  # the best epoch by validation accuracy, not the last
        module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    score = best.best_model_score if best is not None else None
    return Fitted(trainer, curves, path, float(score) if score is not None else float("nan"), attention)


@contextlib.contextmanager
def attention_while_training(module: L.LightningModule, attention: Choice) -> Iterator[None]:
    """`module.model` (a Hugging Face model) runs `attention`'s kernel while the block trains, and its own again
    after it, so what is scored and saved afterwards is the model as loaded. A model without a switchable
    attention (NNCF's fake-quantized graph: int8-qat-openvino's QAT) is left as it is."""
    model = getattr(module, "model", None)
    loaded = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention.value == "as loaded" or loaded in (None, attention.value) or \
            not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(attention.value)
    try:
        yield
    finally:
        model.set_attn_implementation(loaded)


def scoring_device(dm: IMDBDataModule) -> str:
    """The device `predict_split` scores on: the one training used."""
    from pipeline.core.machine import trains_on_cuda

    return "cuda" if trains_on_cuda(dm.params.accelerator) else "cpu"


def predict_split(module: L.LightningModule, dm: IMDBDataModule, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """Logits and true labels for a split (rank 0, single process), scored as the evaluate stage scores.

    Scored in full precision on the device training used (`scoring_device`; Lightning hands the module back on
    the CPU), and left on the CPU afterwards for saving."""
    from pipeline.runtimes.eager import predict_logits_on

    module.eval()
    ds = dm.datasets[split]
    logits = predict_logits_on(module.model, scoring_device(dm), ds.input_ids, dm.params.eval_batch_size,
                               dm.collate.pad_id, progress=f"score {split}")
    return logits, ds.labels


def save_model(model: torch.nn.Module, tokenizer: Any, model_dir: Path, data: DataParams,
               model_params: ModelParams, params: TrainParams, choices: Sequence[Choice] = (),
               extra: dict[str, Any] | None = None) -> None:
    """HF weights + config (with id2label) + tokenizer + the preprocessing that inference must repeat, and the
    machine-dependent choices training made (`auto` settings, with the CPU they were resolved on); `extra`
    sections join the record (the distill stage's `distillation`)."""
    from pipeline.core.io import directory_replaced_on_success
    from pipeline.core.machine import isa_record

    # built aside and swapped in whole, `pipeline.json` last: a kill mid-save never leaves new weights beside the
    # previous run's record (or a half-written safetensors file a later stage loads)
    with directory_replaced_on_success(model_dir, complete_when="pipeline.json") as work:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        meta = {
            "format": "huggingface", "dtype": "float32", "task": "sentiment", "labels": model.config.id2label,
            "preprocessing": {"max_length": data.max_length, "truncation": data.truncation,
                              "head_fraction": data.head_fraction, "clean": "strip <br /> and collapse spaces"},
            "params": {"data": to_dict(data), "model": to_dict(model_params), "train": to_dict(params)},
            "choices": {c.setting: c.to_dict() for c in choices}, "built_on": isa_record(), **(extra or {}),
        }
        write_json(work / "pipeline.json", meta)
