"""Unit: quantization-aware training (fake quantization as onnxruntime quantizes, wrapping and unwrapping,
distillation loss, the int8-qat build)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import QuantizeParams
from pipeline.modeling import load_finetuned
from tests.factories import weight_format_here


@pytest.mark.parametrize(("weight_format", "ort_type", "reduce_range", "levels"),
                         [("s8", "INT8", False, (-127, 127)), ("s7", "INT8", True, (-64, 64)),
                          ("u8", "UINT8", False, (0, 255))])
def test_qat_fake_quant_is_onnxruntimes_quantization_of_the_same_tensors(weight_format, ort_type, reduce_range,
                                                                         levels):
    """The fake-quantized weight and input are what onnxruntime's QDQ conversion makes of them in each weight
    format, with the weight symmetry the static conversion uses (`calibration_options`): per-channel weights on its
    grid (int8 +-127 or +-64 reduced, uint8 about zero point 128) and per-tensor uint8 asymmetric inputs, same
    scales, zero points and levels."""
    import torch
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    from pipeline.surgery.fake_quant import FakeQuantLinear
    from pipeline.variants.calibration import calibration_options

    torch.manual_seed(0)
    x = 3.0 * torch.randn(4, 6, 32) + 1.0  # one batch: the moving-average range starts at its min/max
    symmetric = calibration_options("minmax", QuantizeParams(), activation_symmetric=False)["extra_options"][
        "WeightSymmetric"]
    layer = FakeQuantLinear(torch.nn.Linear(32, 8), weight_format)
    assert (layer.weight_fq.quant_min, layer.weight_fq.quant_max) == levels
    layer(x)
    w = layer.linear.weight.detach()
    fake_w = layer.weight_fq(w).detach().numpy()
    lows, highs = [], []
    for row, fake_row, scale, zero in zip(w.numpy(), fake_w, layer.weight_fq.scale.numpy(),
                                          layer.weight_fq.zero_point.numpy(), strict=True):
        ort_zero, ort_scale, ort_q = quantize_data(row, getattr(TensorProto, ort_type), symmetric,
                                                   reduce_range=reduce_range)
        assert int(ort_zero) == int(zero) and np.isclose(scale, ort_scale, rtol=1e-6)
        expected = (ort_q.astype(np.float32) - float(ort_zero)) * float(ort_scale)
        np.testing.assert_allclose(fake_row, expected, rtol=1e-6, atol=1e-6)
        lows.append(int(ort_q.min()))
        highs.append(int(ort_q.max()))
    # every row reaches one end of its grid (symmetric: its largest |w| sits at the end of its side)
    assert all(low == levels[0] or high == levels[1] for low, high in zip(lows, highs, strict=True))
    ort_zero, ort_scale, ort_q = quantize_data(x.numpy().ravel(), TensorProto.UINT8, False)
    assert float(layer.input_fq.scale) == pytest.approx(float(ort_scale), rel=1e-6)
    assert int(layer.input_fq.zero_point) == int(ort_zero)
    dequantized = (ort_q.astype(np.float32) - float(ort_zero)) * float(ort_scale)
    np.testing.assert_allclose(layer.input_fq(x).numpy().ravel(), dequantized, rtol=1e-5, atol=1e-5)


def test_fake_quant_wraps_every_linear_but_the_skipped_and_removal_restores_them(tiny_model_dir):
    """Every Linear gets fake quantization (those with `skip_in_features` inputs excepted); removal puts the
    same Linear modules back, whose weights QAT trained in place."""
    import torch

    from pipeline.surgery.fake_quant import FakeQuantLinear, add_fake_quant, remove_fake_quant

    model, _, _ = load_finetuned(tiny_model_dir)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ffn_down = [m for m in linears.values() if m.in_features == 128]
    assert len(linears) == 2 * 6 + 2 and len(ffn_down) == 2  # 6 Linear per layer x 2, pooler, classifier
    assert add_fake_quant(model, skip_in_features=128) == len(linears) - len(ffn_down)
    wrapped = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert len(wrapped) == len(linears) - len(ffn_down)
    inside = {id(m.linear) for m in wrapped}
    left = [m for m in model.modules() if type(m) is torch.nn.Linear and id(m) not in inside]
    assert [m.in_features for m in left] == [128, 128]
    assert remove_fake_quant(model) == len(wrapped)
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    restored = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert restored.keys() == linears.keys() and all(restored[n] is linears[n] for n in linears)


def test_qat_really_trained_with_fake_quant(built):
    from pipeline.surgery.fake_quant import FAKE_QUANT_API

    report = built["quantize"]["int8-qat"]
    assert report["fake_quant_layers"] == 2 * 5 + 2  # 5 quantized Linear per layer x 2 layers + pooler + classifier
    assert report["qat_steps"] == 4
    assert FAKE_QUANT_API in report["method"] and FAKE_QUANT_API.startswith("torchao.")


def test_qat_loss_is_labels_only_or_distilled(tiny_model_dir):
    """distillation 0 trains on cross-entropy (≈ ln 2 for an untrained head); 1 on KL to FP32 (≈ 0 at the start)."""
    import math

    from pipeline.training.qat import QatRun, qat_finetune

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=24) for _ in range(8)]
    labels = [i % 2 for i in range(8)]
    losses = {}
    for weight in (0.0, 1.0):
        model, _, _ = load_finetuned(tiny_model_dir)
        params = QuantizeParams(qat_epochs=1, qat_batch_size=4, qat_lr=0.0, qat_distillation=weight,
                                weight_format=weight_format_here().value, qat_precision="32-true")
        result = qat_finetune(model, QatRun(reviews=seqs, labels=labels, params=params, lr=params.qat_lr))
        assert result.steps == 2
        losses[weight] = result.final_loss
    assert abs(losses[0.0] - math.log(2)) < 0.2
    assert 0.0 <= losses[1.0] < 0.05


def test_a_qat_checkpoint_resumes_only_for_the_same_trajectory(tmp_path):
    """`qat_checkpoints` resumes for the same settings, model structure and code, and starts fresh, saying why,
    when the model about to train has other parameters (a checkpoint of another graph would not load), the
    attention kernel QAT's own Trainer runs (from `quantize.qat_precision`, not the finetune's `train.precision`)
    differs, or the builder's own module changed."""
    import torch

    from pipeline.core.params import TrainParams
    from pipeline.training.qat import qat_checkpoints

    train = TrainParams(checkpoint_dir=str(tmp_path / "ckpt"), precision="32-true")
    builder = tmp_path / "builder.py"
    builder.write_text("# v1\n")
    settings = {"qat_lr": 1e-5, "reviews": "abc"}

    def plan(model: torch.nn.Module, precision: str = "32-true", **changed):
        store, p = qat_checkpoints(train, "qat-x", {**settings, **changed}, model, [], code=[builder],
                                   quantize=QuantizeParams(qat_precision=precision))
        (store.dir / "periodic").mkdir(parents=True, exist_ok=True)
        torch.save({}, store.dir / "periodic" / "step=5.ckpt")  # as a periodic checkpoint of that run would be
        return p

    assert not plan(torch.nn.Linear(4, 2)).resumed
    assert plan(torch.nn.Linear(4, 2)).step == 5
    reason = plan(torch.nn.Linear(4, 3)).reason
    assert "structure" in reason and len(reason) < 300, reason
    assert "qat_lr" in plan(torch.nn.Linear(4, 3), qat_lr=2e-5).reason
    # bf16 QAT on the CPU trains with eager attention, 32-true with the model's own: another trajectory
    assert "attention" in plan(torch.nn.Linear(4, 3), "bf16-mixed", qat_lr=2e-5).reason
    assert plan(torch.nn.Linear(4, 3), "bf16-mixed", qat_lr=2e-5).step == 5
    builder.write_text("# v2\n")
    assert "training code changed" in plan(torch.nn.Linear(4, 3), qat_lr=2e-5).reason


def test_qat_trains_in_one_cpu_process_with_quantizes_own_epochs_and_precision(tmp_path):
    from pipeline.training.loop import build_trainer
    from pipeline.training.qat import qat_train_params

    params = QuantizeParams(qat_epochs=2, qat_precision="32-true")
    train = qat_train_params(params, seed=7)
    assert (train.epochs, train.precision, train.seed) == (2, "32-true", 7)
    trainer = build_trainer(train, tmp_path, [], enable_progress_bar=False, validate=False, model_summary=False)
    assert (type(trainer.accelerator).__name__, trainer.num_devices, trainer.num_nodes, trainer.world_size) == \
        ("CPUAccelerator", 1, 1, 1)
    assert trainer.max_epochs == 2 and trainer.accumulate_grad_batches == 1
