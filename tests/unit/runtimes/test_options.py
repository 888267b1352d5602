"""Unit: a runtime's `load` takes its own options only: a misspelt key or an unknown value is a `VariantError`
naming what the runtime accepts (it used to be ignored, or a bare KeyError), and the options the pipeline passes
still load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.runtimes.base import checked_options
from pipeline.runtimes.eager import TorchRunner
from pipeline.runtimes.openvino import OpenVinoRunner
from pipeline.runtimes.ort import OrtRunner, session_options
from pipeline.runtimes.record import VariantError, VariantInfo
from pipeline.runtimes.torchscript import TorchScriptRunner


def test_checked_options_refuses_unknown_keys_and_values_by_name():
    allowed = {"batching": ("auto", "batched", "rows"), "freeze": (True, False)}
    assert checked_options("x", {"batching": "rows", "freeze": False}, allowed) == {"batching": "rows",
                                                                                  "freeze": False}
    assert checked_options("x", {}, allowed) == {}
    with pytest.raises(VariantError, match=r"x runtime has no option 'batchng'; its options: "
                                           r"batching \('auto' \| 'batched' \| 'rows'\), freeze"):
        checked_options("x", {"batchng": "rows"}, allowed)
    with pytest.raises(VariantError, match=r"option batching='row' is not one of 'auto', 'batched', 'rows'"):
        checked_options("x", {"batching": "row"}, allowed)
    with pytest.raises(VariantError, match="freeze=1 is not one of True, False"):  # 1 == True, but not a bool
        checked_options("x", {"freeze": 1}, allowed)
    # None: any value passes here, the runtime checks it itself (a count), and the message says so
    assert checked_options("x", {"streams": 3}, {"streams": None}) == {"streams": 3}
    with pytest.raises(VariantError, match=r"its options: streams \(checked by the runtime\)"):
        checked_options("x", {"stream": 3}, {"streams": None})


@pytest.mark.parametrize(("runtime", "options", "message"), [
    (OrtRunner, {"optimisation": "all"}, r"onnxruntime runtime has no option 'optimisation'"),
    (OrtRunner, {"optimization": "max"}, r"optimization='max' is not one of 'disable', 'basic', 'extended', 'all'"),
    (OrtRunner, {"batching": "row"}, r"batching='row' is not one of"),
    (OpenVinoRunner, {"optimization": "all"}, r"openvino runtime has no option 'optimization'; its options: batching"),
    (OpenVinoRunner, {"streams": 0}, r"openvino option streams must be an integer of at least 1, not 0"),
    (OpenVinoRunner, {"streams": "2"}, r"openvino option streams must be an integer of at least 1, not '2'"),
    (OpenVinoRunner, {"streams": True}, r"openvino option streams must be an integer of at least 1, not True"),
    (TorchScriptRunner, {"batching": "rows"}, r"torchscript runtime has no option 'batching'; its options: freeze"),
    (TorchRunner, {"autocast": "int4"}, r"autocast='int4' is not one of None, 'bf16', 'fp16'"),
    (TorchRunner, {"readout": True}, r"torch runtime has no option 'readout'"),
])
def test_load_refuses_options_its_runtime_does_not_take(tmp_path, runtime, options, message):
    info = VariantInfo("fp32-onnx", "onnx", "float32", "model.onnx")
    with pytest.raises(VariantError, match=message):
        runtime.load(tmp_path, info, None, **options)  # refused before any file is read


def test_an_unknown_graph_optimization_is_a_variant_error_not_a_key_error():
    with pytest.raises(VariantError, match="unknown onnxruntime graph optimization 'full'; use one of disable, basic"):
        session_options(1, "full")


def _identity_onnx(path: Path) -> Path:
    """A one-node ONNX graph (input_ids -> float logits): enough to open a session or compile a model."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)], "identity",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_the_options_the_pipeline_passes_still_load(tmp_path):
    """onnxruntime's `optimization` and `batching` (the peers benchmark's tuning rows, the batch-invariance
    benchmark), OpenVINO's `batching`; the eager options are loaded by the benchmark's reference rows."""
    import openvino as ov

    model = _identity_onnx(tmp_path / "onnx" / "model.onnx")
    ort_info = VariantInfo("fp32-onnx", "onnx", "float32", "model.onnx")
    runner = OrtRunner.load(model.parent, ort_info, 1, optimization="basic", batching="batched")
    assert runner.describe() == {"runtime": "onnxruntime", "threads": 1, "optimization": "basic",
                                 "batching": "batched"}
    ov.save_model(ov.convert_model(str(model)), str(tmp_path / "ir" / "model.xml"))
    ov_info = VariantInfo("int8-openvino", "openvino", "int8", "model.xml")
    ov_runner = OpenVinoRunner.load(tmp_path / "ir", ov_info, 1, batching="rows")
    described = ov_runner.describe()
    assert described["batching"] == "rows" and described["threads"] == 1
    # the precision the CPU plugin chose, by OpenVINO's short name (bf16 only where the CPU has native bf16)
    assert described["inference_precision"] in ("f32", "bf16", "f16")
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.testing.assert_array_equal(ov_runner(ids, np.ones_like(ids)), ids.astype(np.float32))
    assert described["streams"] == 1  # as served: one stream
    # the evaluate stage's side-by-side calls: two streams sharing the two threads, the same answers
    two = OpenVinoRunner.load(tmp_path / "ir", ov_info, 2, batching="rows", streams=2)
    assert two.describe()["streams"] == 2 and two.describe()["threads"] == 2
    np.testing.assert_array_equal(two(ids, np.ones_like(ids)), ids.astype(np.float32))
