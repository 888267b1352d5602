"""Unit: quantization-aware training (fake-quant grid, distillation loss, the int8-qat build)."""

from __future__ import annotations

import numpy as np

from pipeline.core.params import QuantizeParams
from pipeline.modeling import load_finetuned


def test_qat_fake_quant_matches_the_reduced_weight_grid():
    import torch

    from pipeline.variants.qat import FakeQuantLinear

    torch.manual_seed(0)
    for reduce_range, qmax in ((True, 64), (False, 127)):
        layer = FakeQuantLinear(torch.nn.Linear(32, 8), reduce_range)
        layer(torch.randn(4, 32))  # observers see the weight once
        w = layer.linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / qmax
        levels = (layer.weight_fq(w) / scale).detach()
        assert torch.allclose(levels, levels.round(), atol=1e-3)
        assert levels.abs().max() <= qmax + 1e-3 and levels.abs().max() >= qmax - 1e-3


def test_qat_really_trained_with_fake_quant(built):
    report = built["quantize"]["int8-qat"]
    assert report["fake_quant_layers"] == 2 * 5 + 2  # 5 quantized Linear per layer x 2 layers + pooler + classifier
    assert report["qat_steps"] == 4


def test_qat_distillation_loss():
    import torch

    from pipeline.variants.qat import distillation_loss

    logits = torch.tensor([[2.0, -1.0], [0.5, 0.3]])
    labels = torch.tensor([1, 0])
    ce = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.isclose(distillation_loss(logits, logits + 5.0, labels, 0.0), ce)  # labels only
    assert distillation_loss(logits, logits, labels, 1.0).abs() < 1e-6  # already matches FP32: nothing to learn
    assert distillation_loss(logits, logits.flip(-1), labels, 1.0) > 0.1
    half = distillation_loss(logits, logits, labels, 0.5)
    assert torch.isclose(half, 0.5 * ce, atol=1e-6)


def test_qat_loss_is_labels_only_or_distilled(tiny_model_dir):
    """distillation 0 trains on cross-entropy (≈ ln 2 for an untrained head); 1 on KL to FP32 (≈ 0 at the start)."""
    import math

    from pipeline.variants.qat import qat_finetune

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=24) for _ in range(8)]
    labels = [i % 2 for i in range(8)]
    losses = {}
    for weight in (0.0, 1.0):
        model, _, _ = load_finetuned(tiny_model_dir)
        result = qat_finetune(model, seqs, labels,
                              QuantizeParams(qat_epochs=1, qat_batch_size=4, qat_lr=0.0, qat_distillation=weight))
        assert result.steps == 2
        losses[weight] = result.final_loss
    assert abs(losses[0.0] - math.log(2)) < 0.2
    assert 0.0 <= losses[1.0] < 0.05
