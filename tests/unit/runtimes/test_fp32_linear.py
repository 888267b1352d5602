"""Unit: the kernel of PyTorch's FP32 `Linear` layers (`pipeline.runtimes.fp32_linear`): which one each CPU gets and
why, and that oneDNN's layers compute the same logits on a copy, leaving the model and its fake-quantized layers
alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.runtimes.eager import TorchRunner, logits_module, predict_logits_on
from pipeline.runtimes.fp32_linear import onednn_linear, onednn_linear_works, onednn_linears, resolve_fp32_linear
from pipeline.runtimes.registry import load_runner

AVX512 = frozenset({"avx2", "avx512f", "avx512_vnni"})
needs_onednn = pytest.mark.skipif(bool(onednn_linear_works()), reason=onednn_linear_works() or "works")


@pytest.mark.parametrize(("vendor", "flags", "mkl", "expected", "why"), [
    ("GenuineIntel", AVX512, True, "torch", "an Intel CPU"),
    ("AuthenticAMD", frozenset({"avx2", "fma"}), True, "torch", "no AVX512F"),
    ("AuthenticAMD", AVX512, False, "torch", "BLAS is not MKL"),
    ("AuthenticAMD", AVX512, True, "onednn", "MKL's sgemm does not run its AVX512 kernels"),
    ("HygonGenuine", AVX512, True, "onednn", "HygonGenuine CPU with AVX512F"),
])
def test_auto_picks_onednn_only_off_intel_with_avx512_and_mkl(monkeypatch, vendor, flags, mkl, expected, why):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    monkeypatch.setattr("pipeline.runtimes.fp32_linear.onednn_linear_works", lambda: "")
    choice = resolve_fp32_linear("auto", flags=flags, vendor=vendor)
    assert (choice.setting, choice.asked, choice.value) == ("fp32_linear", "auto", expected)
    assert why in choice.reason


def test_a_broken_onednn_linear_keeps_pytorchs_own_call_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setattr("pipeline.runtimes.fp32_linear.onednn_linear_works", lambda: "no such op")
    choice = resolve_fp32_linear("auto", flags=AVX512, vendor="AuthenticAMD")
    assert choice.value == "torch" and "no such op" in choice.reason
    with pytest.raises(RuntimeError, match="onednn was asked for, but no such op"):
        resolve_fp32_linear("onednn")
    assert resolve_fp32_linear("torch").value == "torch"  # asking for PyTorch's own call never needs oneDNN


def test_decisions_made_with_other_flags_say_so(monkeypatch):
    monkeypatch.setenv("PIPELINE_CPU_FLAGS", "avx2 fma")
    choice = resolve_fp32_linear("auto", vendor="AuthenticAMD")
    assert choice.value == "torch" and "PIPELINE_CPU_FLAGS" in choice.reason


def test_the_probe_leaves_the_seeded_random_stream_alone(monkeypatch):
    from pipeline.runtimes import fp32_linear

    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    fp32_linear.onednn_linear_works.cache_clear()
    torch.manual_seed(7)
    resolve_fp32_linear("auto", flags=AVX512, vendor="AuthenticAMD")  # probes oneDNN (first call in the process)
    after_probe = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after_probe, torch.rand(3))


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="fp32_linear must be one of auto, onednn, torch"):
        resolve_fp32_linear("openblas")


@needs_onednn
def test_onednn_layers_give_the_models_logits_on_a_copy(tiny_model_dir, tokenizer):
    from pipeline.modeling import load_finetuned

    model, _, _ = load_finetuned(tiny_model_dir)
    plain = logits_module(model.eval())
    fast = onednn_linears(plain)
    assert all(type(m) is not torch.nn.Linear for m in fast.modules())
    assert any(type(m) is torch.nn.Linear for m in plain.modules())  # the original keeps its layers
    ids = torch.tensor(tokenizer(["a fine film", "dull, long and far too loud"], padding=True)["input_ids"])
    mask = (ids != tokenizer.pad_token_id).long()
    with torch.inference_mode():
        want, got = plain(ids, mask), fast(ids, mask)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@needs_onednn
def test_subclasses_of_linear_are_left_alone_and_other_dtypes_are_refused():
    class FakeQuantized(torch.nn.Linear):
        pass

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantized(8, 4))
    fast = onednn_linears(net)
    assert type(fast[0]) is not torch.nn.Linear and type(fast[1]) is FakeQuantized
    only_subclasses = torch.nn.Sequential(FakeQuantized(8, 4))
    assert onednn_linears(only_subclasses) is only_subclasses  # nothing to replace: the module itself, not a copy
    hooked, bf16 = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4).bfloat16()
    hooked.register_forward_hook(lambda *_: None)
    for kept in (hooked, bf16):  # a hook the replacement would not call; weights that are not FP32
        net = torch.nn.Sequential(kept)
        assert onednn_linears(net) is net
        assert TorchRunner(net, fp32_linear="auto").describe()["fp32_linear"] == "torch"
    with pytest.raises(TypeError, match="float32 inputs only"):
        onednn_linear(torch.nn.Linear(8, 4))(torch.ones(2, 8, dtype=torch.bfloat16))
    x = torch.randn(3, 8)
    no_bias = torch.nn.Linear(8, 4, bias=False)
    with torch.inference_mode():
        assert torch.allclose(onednn_linear(no_bias)(x), no_bias(x), atol=1e-6)


def test_runners_record_the_kernel_and_keep_the_module_where_it_does_not_apply(tiny_model_dir):
    from pipeline.modeling import load_finetuned

    model, _, _ = load_finetuned(tiny_model_dir)
    module = logits_module(model.eval())
    assert TorchRunner(module).module is module and "fp32_linear" not in TorchRunner(module).describe()
    bf16 = TorchRunner(module, autocast="bf16", fp32_linear="auto")
    assert bf16.module is module and bf16.describe()["fp32_linear"] == "torch"
    assert "bf16 autocast" in bf16.describe()["fp32_linear_reason"]
    asked = TorchRunner(module, fp32_linear="torch")
    assert asked.module is module and asked.describe()["fp32_linear_reason"] == "set explicitly"
    auto = load_runner(tiny_model_dir).describe()
    assert auto["fp32_linear"] == resolve_fp32_linear("auto").value
    assert load_runner(tiny_model_dir, fp32_linear="torch").describe()["fp32_linear"] == "torch"


def test_scripted_modules_run_their_own_ops():
    from pipeline.runtimes.torchscript import legacy_torchscript

    with legacy_torchscript():
        scripted = torch.jit.script(torch.nn.Linear(4, 2))
    runner = TorchRunner(scripted, fp32_linear="auto")
    assert runner.module is scripted and "TorchScript" in runner.describe()["fp32_linear_reason"]


@needs_onednn
def test_scoring_on_onednn_leaves_the_trained_model_as_it_was(tiny_model_dir, tokenizer):
    from pipeline.modeling import load_finetuned

    model, _, _ = load_finetuned(tiny_model_dir)
    before = {n: type(m) for n, m in model.named_modules()}
    seqs = [np.array(tokenizer(t)["input_ids"]) for t in ("great", "awful, truly awful", "fine")]
    logits = predict_logits_on(model, "cpu", seqs, 2, tokenizer.pad_token_id)
    want = TorchRunner(logits_module(model.eval()))
    for i, s in enumerate(seqs):
        assert np.allclose(logits[i], want(s[None], np.ones((1, len(s)), dtype=np.int64))[0], atol=1e-5)
    assert {n: type(m) for n, m in model.named_modules()} == before
