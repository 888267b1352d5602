"""Unit: `benchmarks.onnx_ab`'s operator profile on a two-node graph: every profiled run is counted once, the
warm-up left out, each operator type's kernels found. Never timings."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from benchmarks.onnx_ab import main, op_profile
from pipeline.core.io import read_json


@pytest.fixture
def two_op_graph(tmp_path):
    """input_ids, attention_mask (int64) -> Cast to float each -> Add: one Add and two Cast kernels a run."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"]) for n in ("input_ids", "attention_mask")]
    nodes = [helper.make_node("Cast", ["input_ids"], ["a"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["a", "m"], ["logits"])]
    graph = helper.make_graph(nodes, "two-op", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return path


def test_the_profile_counts_each_kernel_once_a_run_and_leaves_the_warm_up_out(two_op_graph):
    ids = np.ones((1, 8), dtype=np.int64)
    profile = op_profile(two_op_graph, {"input_ids": ids, "attention_mask": ids}, threads=1, runs=7)
    assert profile["runs"] == 7
    assert {op: row["kernels_per_run"] for op, row in profile["ops"].items()} == {"Cast": 2.0, "Add": 1.0}
    assert all(row["us_per_run"] >= 0 for row in profile["ops"].values()) and profile["run_us_median"] > 0


def test_the_command_writes_timings_and_profiles_for_each_file(two_op_graph, tmp_path, capsys):
    out = tmp_path / "ab.json"
    main([str(two_op_graph), "--seq-len", "8", "--rounds", "1", "--block", "2", "--threads", "1",
          "--op-profile", "3", "--out", str(out)])
    result = read_json(out)
    assert set(result["models"]) == set(result["op_profiles"]) == {str(two_op_graph)}
    assert result["models"][str(two_op_graph)]["runs"] == 2
    assert "| Add |" in capsys.readouterr().out


def test_an_openvino_ir_is_timed_beside_the_onnx_file_and_the_cpu_recorded(two_op_graph, tmp_path):
    """The same graph as OpenVINO IR: both files timed in one command, the machine (CPU, ISA flags) in the result;
    the operator profile, onnxruntime's, is refused for an IR rather than run on something else."""
    import openvino as ov

    ir = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(str(two_op_graph)), str(ir))
    out = tmp_path / "ab.json"
    main([str(two_op_graph), str(ir), "--seq-len", "8", "--rounds", "2", "--block", "2", "--threads", "1",
          "--out", str(out)])
    result = read_json(out)
    assert {m: r["runs"] for m, r in result["models"].items()} == {str(two_op_graph): 4, str(ir): 4}
    assert result["machine"]["cpu"] and "avx2" in result["machine"]["isa"]
    with pytest.raises(SystemExit):
        main([str(ir), "--op-profile", "3", "--out", str(tmp_path / "no.json")])
    assert not (tmp_path / "no.json").exists()
