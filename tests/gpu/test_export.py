"""GPU: exports of a model that lives on CUDA (TorchScript and ONNX), checked against the CUDA eager model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.params import ExportParams
from pipeline.modeling import load_finetuned
from pipeline.runtimes.base import pad_batch
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.torchscript import legacy_torchscript
from pipeline.variants.export import eager_runner, export_onnx, export_torchscript

pytestmark = pytest.mark.gpu


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=n) for n in (5, 17, 40, 64)]
    return pad_batch(seqs)


def test_onnx_export_from_cuda_matches_cuda_eager(tmp_path, tiny_model_dir):
    model, _tok, _meta = load_finetuned(tiny_model_dir)
    model = model.cuda()
    export_onnx(model, tmp_path / "model.onnx", max_length=64, opset=ExportParams().opset)
    ids, mask = _batch()
    reference = eager_runner(model)(ids, mask)
    got = OrtRunner(tmp_path / "model.onnx")(ids, mask)
    assert np.abs(reference - got).max() < 1e-3


def test_torchscript_trace_on_cuda_runs_on_cuda(tmp_path, tiny_model_dir):
    model, _tok, _meta = load_finetuned(tiny_model_dir)
    model = model.cuda()
    export_torchscript(model, tmp_path / "model.pt", max_length=64)
    with legacy_torchscript():
        traced = torch.jit.load(str(tmp_path / "model.pt"), map_location="cuda")
    ids, mask = _batch()
    with torch.inference_mode():
        got = traced(torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda())
    assert got.device.type == "cuda"
    assert np.abs(eager_runner(model)(ids, mask) - got.float().cpu().numpy()).max() < 1e-4
