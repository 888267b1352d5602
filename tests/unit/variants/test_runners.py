"""Unit: runners honour their thread settings."""

from __future__ import annotations

import torch

from pipeline.modeling import load_finetuned
from pipeline.variants.export import export_onnx
from pipeline.variants.runners import OrtRunner, load_runner


def test_ort_session_threads(tmp_path, tiny_model_dir):
    model, _, _ = load_finetuned(tiny_model_dir)
    export_onnx(model, tmp_path / "m.onnx", 32)
    runner = OrtRunner(tmp_path / "m.onnx", threads=1)
    assert runner.session.get_session_options().intra_op_num_threads == 1


def test_thread_settings_are_honoured(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        load_runner(tiny_model_dir, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
