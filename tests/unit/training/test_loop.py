"""The one training loop (`pipeline.training.loop`): every Trainer of the pipeline comes from `build_trainer`, which
turns Lightning's checkpointing and validation on only where the job asks for them; the curves write their plots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.core.params import TrainParams
from pipeline.training.curves import CurveRecorder
from pipeline.training.loop import BestByAccuracy, best_checkpoint, build_trainer
from tests.factories import ROOT


def test_build_trainer_is_the_only_trainer_in_the_pipeline():
    made = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "pipeline").rglob("*.py"))
            if re.search(r"\bL\.Trainer\(|\bTrainer\(", p.read_text())]
    assert made == ["pipeline/training/loop.py"]


def test_checkpointing_and_validation_only_where_asked(tmp_path: Path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    params = TrainParams(precision="32-true")
    plain = build_trainer(params, tmp_path, [], enable_progress_bar=False, validate=False)
    assert plain.checkpoint_callback is None  # no unread default checkpoint in the work dir
    assert plain.limit_val_batches == 0
    best = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="val_acc", mode="max")
    validated = build_trainer(params, tmp_path, [best], enable_progress_bar=False)
    assert validated.checkpoint_callback is best
    assert validated.limit_val_batches == 1.0


def test_an_unresolved_precision_is_refused_with_where_to_resolve_it(tmp_path: Path):
    with pytest.raises(ValueError, match="resolve_auto"):
        build_trainer(TrainParams(), tmp_path, [], enable_progress_bar=False)


def test_the_finetune_speed_benchmark_trains_with_the_default_settings_resolved():
    """`benchmarks.finetune_speed` times the default profile's training, `auto` resolved as a stage resolves it."""
    from benchmarks.finetune_speed import training_settings
    from pipeline.core.params import Params, resolve_auto

    settings = training_settings(seed=3, threads=2, compile_model=False)
    defaults = Params()
    assert settings.precision == resolve_auto(defaults).precision.value != "auto"
    assert (settings.epochs, settings.seed, settings.threads) == (1, 3, 2)
    assert (settings.batch_size, settings.lr, settings.attention_dropout) == \
        (defaults.train.batch_size, defaults.train.lr, defaults.train.attention_dropout)


def test_curves_write_their_plots_and_final_loss(tmp_path: Path):
    curves = CurveRecorder()
    curves.train_rows = [{"step": i, "train_loss": float(i), "lr": 0.1} for i in range(1, 13)]
    curves.write(tmp_path)
    assert (tmp_path / "train.csv").read_text().splitlines()[:2] == ["step,train_loss,lr", "1,1.0,0.1"]
    assert (tmp_path / "val.csv").read_text().splitlines() == ["step,epoch,val_acc,val_loss"]
    assert curves.final_loss(10) == sum(range(3, 13)) / 10
    assert CurveRecorder().final_loss() == 0.0 and CurveRecorder().samples_per_s == 0.0


def test_curves_hold_one_row_per_optimizer_step_with_the_windows_mean_loss():
    """With gradient accumulation (2 micro-batches a step, the epoch's 5th batch a partial window) each optimizer
    step is one row, stamped with the step it completed, whose loss is its window's mean."""
    from types import SimpleNamespace

    import torch

    progress = SimpleNamespace(is_last_batch=False)
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, global_step=0, accumulate_grad_batches=2,
                              num_training_batches=5, callback_metrics={},
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 0.1}])],
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    batch = {"labels": torch.zeros(4), "attention_mask": torch.ones(4, 8)}
    curves = CurveRecorder()
    curves.on_train_epoch_start(trainer, None)
    for batch_idx, loss in enumerate([1.0, 3.0, 2.0, 4.0, 5.0]):
        trainer.callback_metrics = {"train_loss": torch.tensor(loss)}
        progress.is_last_batch = batch_idx == 4
        if batch_idx % 2 == 1 or batch_idx == 4:  # Lightning steps before the batch-end hooks run
            trainer.global_step += 1
        curves.on_train_batch_start(trainer, None, batch, batch_idx)
        curves.on_train_batch_end(trainer, None, None, batch, batch_idx)
    assert curves.train_rows == [{"step": 1, "train_loss": 2.0, "lr": 0.1}, {"step": 2, "train_loss": 3.0, "lr": 0.1},
                                 {"step": 3, "train_loss": 5.0, "lr": 0.1}]
    assert curves.final_loss() == 10.0 / 3 and curves.samples == 20


def test_the_best_checkpoint_breaks_an_accuracy_tie_on_the_lower_validation_loss(tmp_path: Path):
    """Lightning keeps the first of equally accurate checkpoints; `BestByAccuracy` keeps the one of lower validation
    loss among them, never a less accurate one, and keeps the tie's loss in its state under Lightning's own key."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    best = best_checkpoint(tmp_path / "best")
    assert isinstance(best, BestByAccuracy)
    trainer = SimpleNamespace(callback_metrics={}, strategy=SimpleNamespace(reduce_boolean_decision=lambda d: d))

    def validated(acc: float, loss: float) -> bool:
        """Whether `best` saves after a validation of this accuracy and loss (and, where it does, as Lightning
        records the save)."""
        trainer.callback_metrics = {"val_acc": torch.tensor(acc), "val_loss": torch.tensor(loss)}
        saved = best.check_monitor_top_k(trainer, torch.tensor(acc))
        if saved:
            path = tmp_path / f"step-{acc}-{loss}.ckpt"
            path.touch()
            best.best_k_models = {str(path): torch.tensor(acc)}
            best.kth_best_model_path = best.best_model_path = str(path)
            best.best_model_score = torch.tensor(acc)
        return saved

    assert validated(0.77, 0.56)  # the first
    assert validated(0.77, 0.42)  # as accurate, lower loss: Lightning alone would keep the first
    assert not validated(0.77, 0.50)  # as accurate, higher loss than the kept one
    assert not validated(0.76, 0.10)  # less accurate, whatever its loss
    assert validated(0.78, 0.90)  # more accurate, whatever its loss
    state = best.state_dict()
    assert state["best_tie_score"] == pytest.approx(0.9)
    restored = best_checkpoint(tmp_path / "best")
    restored.load_state_dict(state)
    assert restored.best_tie_score == state["best_tie_score"]
    plain = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="val_acc", mode="max", save_top_k=1,
                            save_on_train_epoch_end=False)
    assert best.state_key == plain.state_key  # a checkpoint Lightning's own class wrote resumes into this one


def test_a_bf16_cpu_fit_trains_with_eager_attention_and_hands_back_the_model_as_loaded():
    """`attention_while_training`: the kernel `training_attention` chose while the block runs (a failed fit
    included), the model's own after it; `as loaded`, or a model without switchable attention, changes nothing."""
    from types import SimpleNamespace

    from pipeline.core.machine import Choice
    from pipeline.core.params import ModelParams
    from pipeline.modeling import load_model
    from pipeline.training.loop import attention_while_training

    model = load_model(ModelParams(source="tiny"))
    loaded = model.config._attn_implementation
    assert loaded == "sdpa"
    eager = Choice("train.attention", "derived", "eager", "bf16 on the CPU")
    module = SimpleNamespace(model=model)
    with pytest.raises(RuntimeError), attention_while_training(module, eager):
        assert model.config._attn_implementation == "eager"
        raise RuntimeError("a fit that fails")
    assert model.config._attn_implementation == loaded
    with attention_while_training(module, Choice("train.attention", "derived", "as loaded", "fp32")):
        assert model.config._attn_implementation == loaded
    with attention_while_training(SimpleNamespace(model=SimpleNamespace()), eager):
        pass  # NNCF's fake-quantized graph has no attention switch: left as it is


def test_a_resume_point_naming_a_best_checkpoint_that_is_gone_drops_its_best_so_far(tmp_path: Path, caplog):
    """A resume point written before a better validation replaced (deleted) the best file it names: loading that
    path when training ends would fail on every rerun, so the restored callback forgets it (logged) and keeps the
    best of the resumed run's own validations; a best file that is there is kept as it was."""
    import torch

    kept = tmp_path / "best" / "best-step=344.ckpt"
    kept.parent.mkdir()
    kept.touch()
    for path, gone in ((kept, False), (tmp_path / "best" / "best-step=100.ckpt", True)):
        state = {"dirpath": str(tmp_path / "best"), "best_model_path": str(path), "best_model_score": torch.tensor(0.8),
                 "best_k_models": {str(path): torch.tensor(0.8)}, "kth_best_model_path": str(path),
                 "kth_value": torch.tensor(0.8), "last_model_path": "", "best_tie_score": 0.3}
        restored = best_checkpoint(tmp_path / "best")
        with caplog.at_level("WARNING", logger="pipeline.training.loop"):
            restored.load_state_dict(state)
        if gone:
            assert restored.best_model_path == "" and restored.best_model_score is None
            assert restored.best_k_models == {} and restored.best_tie_score is None
            assert float(restored.kth_value) == float("-inf") and "is gone" in caplog.text
        else:
            assert restored.best_model_path == str(kept) and restored.best_tie_score == 0.3
