"""Unit: runners honour their thread settings and describe what they run with."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.registry import load_runner


def test_ort_session_threads(built):
    runner = OrtRunner(built["dirs"]["fp32-onnx"] / "model.onnx", threads=1)
    assert runner.session.get_session_options().intra_op_num_threads == 1
    assert runner.describe() == {"runtime": "onnxruntime", "threads": 1, "optimization": "all", "batching": "batched"}


def test_thread_settings_are_honoured(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        runner = load_runner(tiny_model_dir, threads=1)
        assert torch.get_num_threads() == 1
        described = runner.describe()
        assert {k: described.pop(k) for k in ("fp32_linear", "fp32_linear_reason")}  # test_fp32_linear.py
        assert described == {"runtime": "torch", "threads": 1, "device": "cpu", "autocast": "none"}
    finally:
        torch.set_num_threads(before)


def test_torch_runner_autocast_runs_in_the_named_dtype_and_refuses_others():
    import numpy as np
    import pytest
    import torch

    from pipeline.runtimes.eager import TorchRunner

    seen: list[torch.dtype] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.linear(torch.ones(len(input_ids), 4))
            seen.append(out.dtype)
            return out

    ids = np.ones((3, 5), dtype=np.int64)
    for autocast, dtype in ((None, torch.float32), ("bf16", torch.bfloat16)):
        logits = TorchRunner(Probe(), autocast=autocast)(ids, ids)
        assert seen[-1] == dtype and logits.dtype == np.float32 and logits.shape == (3, 2)
    with pytest.raises(ValueError, match="autocast"):
        TorchRunner(Probe(), autocast="int4")


def _identity_onnx(path: Path) -> Path:
    """A one-node ONNX graph (input_ids -> float logits): enough to open a session or compile a model."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)], "identity",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_openvino_pins_no_cores_in_a_process_that_takes_fewer_threads_than_it_may_use(tmp_path, monkeypatch):
    """The CPU plugin pins from the first core in every process: processes that each take part of the machine (Spark
    tasks, pytest-xdist workers, each capped) would all stack on core 0. Pinning stays where a process takes every
    core it may use, and where no thread count is set (the plugin then takes them all)."""
    import openvino as ov

    from pipeline.core import machine
    from pipeline.runtimes import openvino as ov_runtime

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [ov_runtime.pins_cores(t) for t in (None, 1, 3, 4, 8)] == [True, False, False, True, True]
    model = ov.convert_model(str(_identity_onnx(tmp_path / "m.onnx")))
    assert ov_runtime.compiled_model(model, threads=1).get_property("ENABLE_CPU_PINNING") is False
    runner = ov_runtime.OpenVinoRunner.__new__(ov_runtime.OpenVinoRunner)
    runner.compiled, runner.threads, runner.rows_alone = ov_runtime.compiled_model(model, threads=2), 2, False
    assert runner.describe()["cpu_pinning"] is False  # recorded beside the scores and timings


def test_a_null_thread_setting_takes_the_omp_cap_in_onnxruntime_and_openvino(tmp_path, monkeypatch):
    """torch reads OMP_NUM_THREADS itself; onnxruntime and OpenVINO are handed it, so one cap holds for all three."""
    import openvino as ov

    from pipeline.runtimes.openvino import compiled_model
    from pipeline.runtimes.ort import session_options

    model = _identity_onnx(tmp_path / "m.onnx")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert session_options().intra_op_num_threads == 3
    assert session_options(threads=2).intra_op_num_threads == 2  # an explicit setting wins over the cap
    assert OrtRunner(model).describe()["threads"] == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # OpenVINO clamps its threads to the cores there are
    assert compiled_model(ov.convert_model(str(model))).get_property("INFERENCE_NUM_THREADS") == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert session_options().intra_op_num_threads == 0  # onnxruntime's own default
