"""int8-qat-openvino (pipeline/variants/openvino_qat.py): QAT through NNCF's own quantizers, run by OpenVINO."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.core.params import QuantizeParams
from pipeline.modeling import load_finetuned
from pipeline.runtimes.record import read_variant
from tests.factories import qat_precision_here


def _reviews(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 2000, size=int(rng.integers(8, 24))) for _ in range(n)]


@pytest.fixture(scope="module")
def quantized_once(tiny_model_dir):
    """NNCF's fake-quantized tiny model and its FP32 copy, calibrated on 16 synthetic reviews in batches of 8 (an
    `nncf.quantize`: once for the module; each test gets a copy, `quantized`)."""
    from pipeline.variants.openvino_int8 import calibration_batches
    from pipeline.variants.openvino_qat import fake_quantized

    model, _, _ = load_finetuned(tiny_model_dir)
    batches = calibration_batches(_reviews(16), pad_id=0, batch_size=8)
    return (*fake_quantized(model, batches), batches)


@pytest.fixture
def quantized(quantized_once):
    """A copy of `quantized_once` for one test to train or change."""
    import copy

    return copy.deepcopy(quantized_once)


def test_the_variant_is_qat_through_nncf_in_openvino_ir(built, tokenizer):
    """The built variant: OpenVINO IR whose weight products run in INT8 (FakeQuantize nodes as int8-openvino's),
    trained (steps recorded) from NNCF's quantizers, its IR checked against the trained module, and scored by
    `load_runner` within INT8 rounding of fp32-onnx."""
    import openvino as ov

    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.registry import load_runner

    d = built["dirs"]["int8-qat-openvino"]
    info = read_variant(d)
    assert info.status == "ok" and info.format == "openvino" and info.file == "model.xml"
    record = info.params
    assert "NNCF" in record["method"] and record["qat_samples"] == 32 and record["qat_steps"] >= 4
    assert record["qat_lr"] == QuantizeParams().qat_openvino_lr and record["cls_readout"] is True
    # it trained in the precision this machine's stage resolves, and says why
    here = qat_precision_here()
    assert record["qat_precision"] == here.value and record["qat_precision_choice"] == here.tag()
    assert record["parity_batch"] == 16 and record["parity_max_abs_diff"] < 1e-2
    assert record["served_batching"] == "rows"  # static activation scales: one review per call, as int8-openvino
    # one quantizer read by query, key and value in the first layer, by key and value in the last (its query reads
    # only [CLS]: cls_readout)
    assert record["shared_quantizers"] == 2 + 1
    ops = [op.get_type_name() for op in ov.Core().read_model(str(d / "model.xml")).get_ops()]
    assert ops.count("FakeQuantize") >= 2 * 6, sorted(set(ops))
    seqs = [np.asarray(s) for s in pd.read_parquet(built["tokenized"] / "test.parquet")["input_ids"]]
    got = predict_logits(load_runner(d, threads=1), seqs, batch_size=8, pad_id=tokenizer.pad_token_id)
    ref = predict_logits(load_runner(built["dirs"]["fp32-onnx"], threads=1), seqs, batch_size=8,
                         pad_id=tokenizer.pad_token_id)
    assert np.abs(got - ref).max() < 1e-2


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_qat_trains_the_weights_and_the_quantizer_ranges(quantized, precision):
    """At lr 0 nothing moves; at lr > 0 both the model's weights and NNCF's quantizer parameters do (QAT learns
    the ranges too), and the FP32 teacher stays frozen: in fp32 and under bf16 autocast (`quantize.qat_precision`,
    where NNCF's quantizers see bf16 activations), the weights staying fp32."""
    import torch

    from pipeline.training.qat import QatRun, fake_quantized_finetune

    model, teacher, _ = quantized
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    rng = np.random.default_rng(1)
    seqs, labels = _reviews(16, seed=1), [int(x) for x in rng.integers(0, 2, 16)]
    params = QuantizeParams(qat_epochs=1, qat_batch_size=8, qat_precision=precision)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps, _ = fake_quantized_finetune(model, teacher, QatRun(reviews=seqs, labels=labels, params=params, lr=0.0))
    assert steps == 2 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fake_quantized_finetune(model, None, QatRun(reviews=seqs, labels=labels, params=params, lr=1e-2))  # labels only
    moved = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert any("__nncf_hooks" in k for k in moved), sorted(moved)[:5]
    assert any("__nncf_hooks" not in k and k.endswith("weight") for k in moved), sorted(moved)[:5]
    assert all(v.dtype != torch.bfloat16 for v in model.state_dict().values())
    assert all(torch.equal(teacher_before[k], v) for k, v in teacher.state_dict().items())


def test_qat_keeps_one_quantizer_per_tensor_as_int8_openvino(quantized):
    """Query, key and value read one tensor: NNCF on PyTorch hooks a quantizer per reader, which QAT would train
    apart into one `FakeQuantize` per reader in the IR. They share one module, so training keeps the IR's
    quantizers as they were before it (and the model's answers unchanged by the sharing itself)."""
    import collections
    import copy

    import nncf
    import torch

    from pipeline.training.qat import QatRun, fake_quantized_finetune
    from pipeline.variants.openvino_qat import _tensors, share_duplicate_quantizers, shared_quantizers, to_openvino

    model, teacher, batches = quantized
    shared = shared_quantizers(model)
    assert shared >= 2 * 2, shared  # two layers, key and value share query's quantizer at least
    assert share_duplicate_quantizers(model, batches[0]) == shared  # nothing left to share
    # the sharing itself changes no answer: NNCF's own model, before and after
    split = nncf.quantize(copy.deepcopy(teacher), nncf.Dataset(batches, _tensors), subset_size=len(batches),
                          model_type=nncf.ModelType.TRANSFORMER)
    ids = torch.from_numpy(np.stack([r[:8] for r in _reviews(4, seed=3)]))
    with torch.no_grad():
        before = split(ids, torch.ones_like(ids))
        assert shared_quantizers(split) == 0 and share_duplicate_quantizers(split, batches[0]) == shared
        assert torch.equal(split(ids, torch.ones_like(ids)), before)

    def fake_quantizers() -> collections.Counter[str]:
        ops = to_openvino(model, batches[-1]).get_ops()
        return collections.Counter(op.get_type_name() for op in ops)["FakeQuantize"]

    before = fake_quantizers()
    rng = np.random.default_rng(1)
    seqs, labels = _reviews(16, seed=1), [int(x) for x in rng.integers(0, 2, 16)]
    fake_quantized_finetune(model, None, QatRun(reviews=seqs, labels=labels,
                                                params=QuantizeParams(qat_epochs=1, qat_batch_size=8,
                                                                      qat_precision="32-true"), lr=1e-2))
    assert shared_quantizers(model) == shared and fake_quantizers() == before
    ids = torch.from_numpy(np.stack([r[:8] for r in _reviews(4, seed=2)]))
    assert torch.isfinite(model(ids, torch.ones_like(ids))).all()


def test_a_checkpoint_loads_into_the_model_rebuilt_on_resume(quantized, tiny_model_dir):
    """Resuming rebuilds the fake-quantized model from the same inputs and loads the checkpoint into it: the
    quantizers (NNCF keeps them in a submodule) are part of the state, with the same names."""
    import torch

    from pipeline.variants.openvino_qat import fake_quantized

    model, _, batches = quantized
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(0.01)  # as if trained
    model2, _, _ = load_finetuned(tiny_model_dir)
    rebuilt, _ = fake_quantized(model2, batches)
    assert rebuilt.load_state_dict(model.state_dict(), strict=True)
    ids = torch.from_numpy(np.stack([r[:8] for r in _reviews(4, seed=2)]))
    with torch.no_grad():
        assert torch.equal(rebuilt(ids, torch.ones_like(ids)), model(ids, torch.ones_like(ids)))


def test_the_fake_quantizers_are_nncfs_torch_reference_and_nothing_is_compiled(quantized, tmp_path, monkeypatch):
    """NNCF's CPU quantizers are its PyTorch reference functions, called as they are (no C++ extension built, no
    `torch.compile` of them): a training step of the fake-quantized model runs every quantizer's forward and
    backward through them and compiles nothing into `TORCH_EXTENSIONS_DIR`."""
    import torch
    from nncf.torch.quantization.extensions import QuantizedFunctionsCPU
    from nncf.torch.quantization.layers import BaseQuantizer
    from nncf.torch.quantization.reference import torch_executor

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    model, _, batches = quantized
    assert QuantizedFunctionsCPU.get("Quantize_forward") == torch_executor.forward
    assert QuantizedFunctionsCPU.get("Quantize_backward") == torch_executor.backward
    calls = {"Quantize_forward": 0, "Quantize_backward": 0}
    namespace = QuantizedFunctionsCPU._loaded_namespace

    def counted(name: str):
        fn = getattr(namespace, name)

        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for name in calls:
        monkeypatch.setattr(namespace, name, counted(name))
    ids, mask = (torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in batches[0])
    model.train()
    try:
        model(ids, mask).sum().backward()
    finally:
        model.eval()
    quantizers = sum(isinstance(m, BaseQuantizer) for m in model.modules())
    assert calls["Quantize_forward"] >= quantizers > 0 and calls["Quantize_backward"] > 0, (calls, quantizers)
    assert not (tmp_path / "ext").exists()


def test_quantizing_only_the_rows_a_batch_reads_changes_no_answer_and_no_gradient(quantized):
    """`embedding_rows_quantized` (QAT's steps quantize the looked-up rows of each embedding table, not the whole
    table): on a padded batch, the same logits and the same gradients of every weight and every quantizer
    parameter as NNCF's whole-table hook (the tables' scales within summation order), and NNCF's hooks, the
    quantizers' state and the IR's quantizers as before once it closes."""
    import collections

    import torch

    from pipeline.variants.openvino_qat import _quantizer_slots, embedding_rows_quantized, to_openvino

    model, _, batches = quantized
    ids, mask = (torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in batches[-1])
    assert (ids == 0).any() and model.get_submodule("model.bert.embeddings.word_embeddings").padding_idx == 0

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        out = model(ids, mask)
        (out * torch.tensor([1.0, -2.0])).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def fake_quantizers() -> int:
        return collections.Counter(op.get_type_name() for op in to_openvino(model, batches[-1]).get_ops())[
            "FakeQuantize"]

    model.eval()  # no dropout: both passes see the same network
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = fake_quantizers()
    whole, whole_grads = step()
    with embedding_rows_quantized(model) as tables:
        assert tables == 3  # word, position and token type
        rows, rows_grads = step()
    assert torch.equal(rows, whole)
    assert rows_grads.keys() == whole_grads.keys()
    scales = [k for k in whole_grads if "/embedding/" in k]
    assert len(scales) == 3 and all(whole_grads[k].abs().sum() > 0 for k in scales)
    for name, grad in whole_grads.items():
        assert torch.allclose(rows_grads[name], grad, rtol=1e-5, atol=1e-7 * grad.abs().max()), name
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(q.is_enabled_quantization() for *_, q in _quantizer_slots(model))
    assert all(p.requires_grad for n, p in model.named_parameters() if "__nncf_hooks" in n and p.is_floating_point())
    frozen = next(q for _, key, _, q in _quantizer_slots(model) if "word_embeddings/embedding" in key)
    frozen.disable_gradients()  # a scale that does not train stays frozen once the block closes
    with embedding_rows_quantized(model) as tables:
        assert tables == 3 and frozen.scale.requires_grad is False
    assert frozen.is_enabled_quantization() and frozen.scale.requires_grad is False
    frozen.enable_gradients()
    assert fake_quantizers() == converted and torch.equal(step()[0], whole)
