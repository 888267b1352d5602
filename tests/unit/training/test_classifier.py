"""Unit: the Lightning module's settings: CPU-only refusals and the fused optimizer."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.params import TrainParams
from pipeline.modeling import load_finetuned
from pipeline.training.classifier import AccelerationUnavailable, OptimisationRecipe, check_accelerations


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [({"precision": "16-mixed"}, "16-mixed needs CUDA"), ({"accelerator": "gpu"}, "no CUDA device")],
)
def test_gpu_only_settings_fail_fast_on_cpu(overrides, needle, monkeypatch):
    """On a machine without CUDA (here: whatever this one has, CUDA hidden) GPU-only settings are refused up front."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AccelerationUnavailable, match=needle):
        check_accelerations(TrainParams(**overrides))


def test_fused_adamw_takes_the_same_steps_as_the_per_tensor_loop(tiny_model_dir):
    """The fused optimizer is a speed setting: same decay groups, same updates (to float rounding)."""
    from pipeline.training.classifier import build_optimizer

    models = [load_finetuned(tiny_model_dir)[0].train() for _ in range(2)]
    optimizers = [build_optimizer(m, 1e-3, 0.01, fused=f) for m, f in zip(models, (True, False), strict=True)]
    assert optimizers[0].defaults["fused"] is True and not optimizers[1].defaults["fused"]
    no_decay = optimizers[0].param_groups[1]
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    ids = torch.randint(5, 100, (4, 16))
    for model, opt in zip(models, optimizers, strict=True):
        torch.manual_seed(0)  # same dropout masks
        for _ in range(3):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1, 0, 1])).loss.backward()
            opt.step()
            opt.zero_grad()
    start = load_finetuned(tiny_model_dir)[0].state_dict()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    assert any(not torch.equal(a, start[n]) for n, a in models[0].named_parameters())  # it did train


def test_the_recipe_carries_every_optimisation_setting_of_the_train_section():
    params = TrainParams(lr=3e-5, weight_decay=0.1, warmup_ratio=0.2, compile=True, compile_mode="max-autotune",
                         fused_optimizer=False, gradient_checkpointing=True)
    recipe = OptimisationRecipe.of(params)
    assert recipe == OptimisationRecipe(lr=3e-5, weight_decay=0.1, warmup_ratio=0.2, compile_model=True,
                                        compile_mode="max-autotune", fused_optimizer=False,
                                        gradient_checkpointing=True)
    assert OptimisationRecipe.of(params, lr=1e-3) == OptimisationRecipe(**{**vars(recipe), "lr": 1e-3})
    with pytest.raises(TypeError):
        OptimisationRecipe.of(params, learning_rate=1e-3)  # a misspelt override fails, it is not dropped
