"""Unit: TensorRT variants: optimisation profiles, the skip record where no CUDA device is visible, and the
INT8 engine's QDQ input (built and checked on every machine)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.runtimes.record import VariantError, read_variant
from pipeline.runtimes.registry import load_runner
from pipeline.variants.tensorrt import availability, profile_shapes


def test_tensorrt_skip_record(built):
    ok, reason = availability()
    if ok:
        pytest.skip("a CUDA device with TensorRT is present: the engines were really built")
    for name in ("tensorrt-fp16", "tensorrt-int8"):
        info = read_variant(built["dirs"][name])
        assert info.status == "skipped" and info.reason == reason and info.file is None
        assert info.params["profile"]["max"] == [64, 64]
        assert info.params["source_onnx"]  # what the engine would be built from, recorded all the same
        with pytest.raises(VariantError, match="skipped"):
            load_runner(built["dirs"][name])


def test_profile_shapes_validated():
    s = profile_shapes(1, 8, 32, 8, 128, 256)
    assert s.min == (1, 8) and s.opt == (8, 128) and s.max == (32, 256)
    with pytest.raises(ValueError, match="min_batch"):
        profile_shapes(4, 2, 32, 8, 128, 256)
    with pytest.raises(ValueError, match="min_seq"):
        profile_shapes(1, 2, 32, 8, 512, 256)


def test_int8_engine_input_is_symmetric_signed_qdq_only(built):
    """TensorRT's explicit quantization takes signed int8 Q/DQ with zero points 0 and per-channel weights, and
    has no importer for onnxruntime's integer or dynamic-quantization ops."""
    import onnx
    from onnx import numpy_helper

    from pipeline.variants.tensorrt import TENSORRT_QDQ_FILE
    from pipeline.variants.tensorrt_qdq import tensorrt_qdq_problems

    info = read_variant(built["dirs"]["tensorrt-int8"])
    assert info.params["source_onnx"] == TENSORRT_QDQ_FILE
    # calibrated as int8-static chose, and the record says where the method came from
    assert info.params["calibration"] == read_variant(built["dirs"]["int8-static"]).params["calibration"]
    assert info.params["calibration_source"] == "int8-static's choice"
    path = built["dirs"]["tensorrt-int8"] / TENSORRT_QDQ_FILE
    assert tensorrt_qdq_problems(path) == []
    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert not ops & {"DynamicQuantizeLinear", "MatMulInteger", "QAttention", "DynamicQuantizeMatMul", "QLinearMatMul"}
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    for node in qdq:
        zero = inits[node.input[2]]
        assert zero.data_type == onnx.TensorProto.INT8 and not numpy_helper.to_array(zero).any()
    weight_dq = [n for n in qdq if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weight_dq and all(len(inits[n.input[1]].dims) == 1 for n in weight_dq)  # per-channel scales
    # every weight product runs in INT8 but the FFN down-projections, which int8-static quantizes per batch
    # (TensorRT cannot) and which stay float here: the float products are those and the activation-only ones
    assert info.params["float_ffn_output"] == 2  # one per layer of the tiny model
    activation_only = 2 * 2  # scores and context, in each of the tiny model's 2 layers
    assert info.params["float_matmuls"] == info.params["float_ffn_output"] + activation_only
    assert info.params["int8_matmuls"] > 0


def test_int8_engine_input_runs_in_onnxruntime_close_to_fp32(built):
    """onnxruntime runs the TensorRT input, and its validation score is recorded next to fp32-onnx's."""
    from pipeline.runtimes.base import pad_batch
    from pipeline.runtimes.ort import OrtRunner
    from pipeline.variants.tensorrt import TENSORRT_QDQ_FILE

    params = read_variant(built["dirs"]["tensorrt-int8"]).params
    assert 0.0 <= params["source_onnx_val_accuracy"] <= 1.0 and params["val_reviews"] == 32
    assert params["source_onnx_val_loss_pt"] == pytest.approx(
        100 * (params["fp32_onnx_val_accuracy"] - params["source_onnx_val_accuracy"]), abs=1e-3)
    rng = np.random.default_rng(0)
    ids, mask = pad_batch([rng.integers(1000, 2000, size=n) for n in (5, 17, 40, 64)])
    ref = OrtRunner(built["dirs"]["fp32-onnx"] / "model.onnx")(ids, mask)
    got = OrtRunner(built["dirs"]["tensorrt-int8"] / TENSORRT_QDQ_FILE)(ids, mask)
    assert np.abs(ref - got).max() < 0.1 * max(1.0, float(np.abs(ref).max()))


def test_a_uint8_qdq_model_is_refused_as_tensorrt_input(built):
    from pipeline.variants.tensorrt_qdq import tensorrt_qdq_problems

    problems = tensorrt_qdq_problems(built["dirs"]["int8-static"] / "model.onnx")
    assert any("zero point of type UINT8" in p for p in problems)
    assert any("has no TensorRT importer" in p for p in problems)  # the per-batch FFN products


def test_without_engines_auto_does_not_build_the_qdq_input(built, tiny_model_dir, tmp_path):
    """`tensorrt.qdq_input: auto` builds the INT8 engine's input only where engines can be built: elsewhere the
    skipped record says why and how to build it anyway, and no calibration is spent."""
    from pipeline.core.params import Params
    from pipeline.variants.tensorrt import TENSORRT_QDQ_FILE, run_tensorrt

    ok, reason = availability()
    if ok:
        pytest.skip("a CUDA device with TensorRT is present: auto builds the input here")
    report = run_tensorrt(finetuned=tiny_model_dir, fp32_onnx=built["dirs"]["fp32-onnx"],
                          int8_static=built["dirs"]["int8-static"], tokenized=built["tokenized"],
                          variants_root=tmp_path, params=Params())
    info = read_variant(tmp_path / "tensorrt-int8")
    assert info.status == "skipped" and info.reason == reason
    assert info.params["source_onnx"] is None and "tensorrt.qdq_input" in info.params["source_onnx_skipped"]
    assert not (tmp_path / "tensorrt-int8" / TENSORRT_QDQ_FILE).exists()
    assert report["tensorrt-int8"]["status"] == "skipped"
