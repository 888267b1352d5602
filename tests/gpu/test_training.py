"""GPU: mixed-precision and compiled Lightning training steps on CUDA (skipped without a CUDA device).

Each test trains the tiny BERT on the synthetic splits through the pipeline's own module, data module and
trainer, so what runs here is what the finetune stage runs with `train.accelerator: cuda`."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from pipeline.core.params import DataParams, ModelParams, Params, TrainParams, resolve_auto
from pipeline.modeling import load_finetuned, load_model
from pipeline.training.classifier import IMDBDataModule, OptimisationRecipe, SentimentClassifier
from pipeline.training.finetune import FinetuneOutputs, finetune
from pipeline.training.loop import build_trainer

pytestmark = pytest.mark.gpu

CUDA_TRAIN = {"epochs": 3, "batch_size": 8, "eval_batch_size": 16, "lr": 3e-3, "accelerator": "cuda",
              "val_checks_per_epoch": 1, "warmup_ratio": 0.0, "max_length": None}


class MatmulDtypes(L.Callback):
    """Records the dtype of the first encoder Linear's output in every training step."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()
        self.devices: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        linear = next(m for m in pl_module.model.modules() if isinstance(m, torch.nn.Linear))

        def hook(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
            self.dtypes.add(output.dtype)
            self.devices.add(output.device.type)

        linear.register_forward_hook(hook)


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16),
                                                  ("32-true", torch.float32)])
def test_mixed_precision_runs_matmuls_in_half_precision_on_cuda(tmp_path, tokenized_dir, precision, dtype):
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this CUDA device has no bf16 support")
    params = TrainParams(**{**CUDA_TRAIN, "epochs": 1, "precision": precision})
    module = SentimentClassifier(load_model(ModelParams(source="tiny"), seed=0), OptimisationRecipe.of(params))
    probe = MatmulDtypes()
    trainer = build_trainer(params, tmp_path, [probe], enable_progress_bar=False)
    trainer.fit(module, datamodule=IMDBDataModule(tokenized_dir, params))
    assert probe.devices == {"cuda"}
    assert probe.dtypes == {dtype}
    # Mixed precision keeps fp32 master weights: what is saved is float32.
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}


def test_amp_finetune_learns_and_saves_fp32_on_cuda(tmp_path, tokenized_dir):
    out = tmp_path / "out"
    params = TrainParams(**{**CUDA_TRAIN, "precision": "16-mixed", "checkpoint_dir": str(tmp_path / "ckpt")})
    all_params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=params)
    outputs = FinetuneOutputs(out / "model", out / "metrics.json", out / "plots", out / "reports",
                              predictions_path=out / "test-logits.npz")
    result = finetune(tokenized_dir, outputs, all_params, resolve_auto(all_params).precision)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_accuracy"] == result.metrics["test_accuracy"] > 0.75
    model, _tok, meta = load_finetuned(out / "model")
    assert meta["params"]["train"]["precision"] == "16-mixed"
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_training_on_cuda_learns(tmp_path, tokenized_dir, mode):
    """Compiled training learns, also in `reduce-overhead` mode, whose CUDA graphs replay each recorded shape (the
    seed recipe's fastest rows on a GPU; a replay that reused stale inputs or outputs would not learn)."""
    torch._dynamo.reset()
    out = tmp_path / "out"
    params = TrainParams(**{**CUDA_TRAIN, "precision": "16-mixed", "compile": True, "compile_mode": mode,
                            "checkpoint_dir": str(tmp_path / "ckpt")})  # not the checkout's ./checkpoints
    all_params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=params)
    outputs = FinetuneOutputs(out / "model", out / "metrics.json", out / "plots", out / "reports")
    result = finetune(tokenized_dir, outputs, all_params, resolve_auto(all_params).precision)
    # Dynamo really compiled the model's forward (a fallback to eager would leave no graph).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert result.metrics["test_accuracy"] > 0.75


@pytest.mark.parametrize(("precision", "autocast"), [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", None)])
def test_the_teacher_labels_on_the_gpu_in_the_training_precision(tiny_model_dir, precision, autocast):
    """The distill stage's teacher labels reviews on CUDA under the training precision's autocast, agrees with its
    fp32 CPU logits, and is back on the CPU afterwards (the student is built from it there)."""
    import numpy as np

    from pipeline.training.labelling import labelling_setup, teacher_logits

    teacher, _tok, _meta = load_finetuned(tiny_model_dir)
    labelling = labelling_setup(TrainParams(accelerator="gpu"), precision)
    assert (labelling.device, labelling.autocast) == ("cuda", autocast)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=n) for n in (5, 17, 40, 64)]
    on_gpu = teacher_logits(teacher, seqs, 2, 0, labelling)
    assert next(teacher.parameters()).device.type == "cpu"
    on_cpu = teacher_logits(teacher, seqs, 2, 0, labelling_setup(TrainParams(accelerator="cpu"), "32-true"))
    assert np.abs(on_gpu - on_cpu).max() < (5e-2 if autocast else 1e-3)
