"""Unit: the onnxruntime INT8 conversions (QDQ static, per-batch FFN products, weight formats) and their census."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import QuantizeParams
from tests.factories import weight_format_here


def test_static_with_calibrated_ffn_quantizes_every_weight_product_in_qdq(built, tmp_path):
    from pipeline.variants.onnx_census import ffn_output_matmuls, matmul_census
    from pipeline.variants.onnx_int8 import quantize_static_onnx

    src = built["dirs"]["fp32-onnx"] / "model.onnx"
    assert len(ffn_output_matmuls(src, 128)) == 2  # the tiny BERT's FFN is 128 wide: one per layer
    seqs = [np.arange(5, 5 + n) for n in (6, 9, 12, 20)]
    quantize_static_onnx(src, tmp_path / "all.onnx", seqs, "minmax",
                         QuantizeParams(weight_format=weight_format_here().value))
    # 6 weight products a layer in INT8; float: 2 activation products a layer and the head (pooler, classifier)
    assert matmul_census(tmp_path / "all.onnx") == {"int8_matmuls": 2 * 6, "float_matmuls": 2 * 2 + 2}


def test_the_head_is_the_weight_products_after_the_encoders_last_norm(built):
    """`head_matmuls` finds the pooler and the classifier (one row each), in the plain export and in the fused
    graph int8-dynamic quantizes; no encoder product."""
    import onnx

    from pipeline.variants.onnx_census import head_matmuls

    for name in ("fp32-onnx", "int8-dynamic"):
        graph = onnx.load(str(built["dirs"][name] / "model.onnx"), load_external_data=False).graph
        head = head_matmuls(graph)
        weights = {i.name: list(i.dims) for i in graph.initializer}
        shapes = [next(weights[i] for i in n.input[:2] if i in weights) for n in graph.node if n.name in head]
        # the pooler's 64 x 64, then the classifier's 64 -> 2 (a Gemm stores it transposed)
        assert len(head) == 2 and shapes[0] == [64, 64] and sorted(shapes[1]) == [2, 64], (name, head, shapes)


def test_ffn_products_quantized_per_batch_with_int8_weights(built, tmp_path):
    """The FFN down-projections skip calibration: per-batch activation ranges, INT8 weights in the file."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from pipeline.runtimes.ort import OrtRunner
    from pipeline.variants.onnx_census import ffn_output_matmuls
    from pipeline.variants.onnx_int8 import dynamic_int8_matmuls

    for name in ("int8-static", "int8-qat"):
        graph = onnx.load(str(built["dirs"][name] / "model.onnx")).graph
        floats = [i.name for i in graph.initializer
                  if i.data_type == onnx.TensorProto.FLOAT and list(i.dims) == [128, 64]]
        assert floats == [], (name, floats)  # no [128 x 64] float FFN weight left
    src = built["dirs"]["fp32-onnx"] / "model.onnx"
    dst = tmp_path / "ffn-dynamic.onnx"
    ids = np.arange(10, 34).reshape(2, 12)
    mask = np.ones_like(ids)
    reference = OrtRunner(src)(ids, mask)
    assert dynamic_int8_matmuls(src, dst, ffn_output_matmuls(src, 128)) == 2
    graph = onnx.load(str(dst)).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    integer = [n for n in graph.node if n.op_type == "MatMulInteger"]
    assert len(integer) == 2 and all(weights[n.input[1]].dtype == np.int8 for n in integer)
    assert [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and weights[n.input[1]].shape == (128, 64)] == []
    # onnxruntime fuses each per-batch chain into one DynamicQuantizeMatMul when it loads the file.
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(dst), sess_options=opts, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert optimized.count("DynamicQuantizeMatMul") == 2 and "MatMulInteger" not in optimized
    assert np.abs(OrtRunner(dst)(ids, mask) - reference).max() < 5e-2


@pytest.mark.parametrize(("weight_format", "low", "high", "dtype"),
                         [("s7", 32, 65, np.int8), ("u8", 200, 256, np.uint8)])
def test_the_formats_auto_picks_without_vnni_give_exact_int8_products(weight_format, low, high, dtype):
    """Why `quantize.weight_format: auto` avoids s8 on CPUs without VNNI/AMX: u8 x s8 products summed in pairs
    must fit int16 there (AVX2 `vpmaddubsw` saturates; on this project's AVX2 CPU 8-bit signed weights measured
    up to 26 % off). 7-bit signed weights keep the pair sums in range, unsigned 8-bit weights run on the U8U8
    kernels' 16-bit multiplies: both are exact whatever the CPU, which is what this checks through onnxruntime's
    own kernel with the worst case of each (large same-sign activations and weights)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a = rng.integers(200, 256, (16, 256)).astype(np.uint8)  # large activations, like GELU outliers
    b = rng.integers(low, high, (256, 32)).astype(dtype)
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["A", "B"], ["Y"])], "g",
                              [helper.make_tensor_value_info("A", TensorProto.UINT8, list(a.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [16, 32])],
                              [numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    assert np.array_equal(y, a.astype(np.int64) @ b.astype(np.int64))


def one_attention_graph(path, rng):
    """A float graph of one embedding lookup and one fused onnxruntime `Attention` (2 heads, width 8)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(rng.normal(size=(50, 8)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.normal(size=(8, 24)).astype(np.float32) / 3, "weight"),
             numpy_helper.from_array(rng.normal(size=24).astype(np.float32) / 3, "bias")]
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["x"], name="embed"),
             helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.INT32, name="mask"),
             helper.make_node("Attention", ["x", "weight", "bias", "mask"], ["y"], domain="com.microsoft",
                              name="attention", num_heads=2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
                                           helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                                         ["b", "s"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 8])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), path)


def test_static_attention_is_a_qattention_on_a_calibrated_scale_and_computes_the_fused_attention(tmp_path):
    """The static build turns a fused `Attention` into a `QAttention` whose input is quantized with the scale the
    calibration measured (a `QuantizeLinear` on constants, no per-batch `DynamicQuantizeLinear`), and it answers
    what the float op does within INT8 rounding, padding included."""
    import onnx
    import onnxruntime as ort

    from pipeline.variants.onnx_int8 import static_int8_attention

    rng = np.random.default_rng(0)
    one_attention_graph(tmp_path / "float.onnx", rng)
    calibration = [rng.integers(1, 50, n) for n in (4, 5, 7, 9)]
    params = QuantizeParams(weight_format=weight_format_here().value)
    assert static_int8_attention(tmp_path / "float.onnx", tmp_path / "int8.onnx", calibration, "minmax", params) == 1

    model = onnx.load(str(tmp_path / "int8.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert "Attention" not in ops and "DynamicQuantizeLinear" not in ops and ops.count("QAttention") == 1
    quantize = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    assert set(quantize.input[1:]) <= {i.name for i in model.graph.initializer}
    qattention = next(n for n in model.graph.node if n.op_type == "QAttention")
    assert qattention.input[0] == quantize.output[0] and qattention.input[3] == quantize.input[1]

    ids = np.array([[3, 14, 15, 9, 2], [6, 5, 35, 0, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)

    def run(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    reference, quantized = run(tmp_path / "float.onnx"), run(tmp_path / "int8.onnx")
    assert np.abs(quantized - reference).max() <= 0.05 * np.abs(reference).max()


def test_static_build_refuses_a_fused_attention_left_float(tmp_path, monkeypatch):
    """Every fused `Attention` must become a static `QAttention`: one left float is an error, not a slow model."""
    from pipeline.variants import onnx_int8

    one_attention_graph(tmp_path / "float.onnx", np.random.default_rng(1))

    def none_converted(src, dst, *args, **kwargs):
        dst.write_bytes(src.read_bytes())
        return 0

    monkeypatch.setattr(onnx_int8, "static_int8_attention", none_converted)
    calibration = [np.arange(1, n) for n in (5, 8)]
    with pytest.raises(onnx_int8.QuantizeError, match="only 0 of 1 fused attentions"):
        onnx_int8.quantize_static_onnx_methods(tmp_path / "float.onnx", {"minmax": tmp_path / "int8.onnx"},
                                               calibration, QuantizeParams(weight_format=weight_format_here().value))


def test_static_products_read_calibrated_inputs_and_write_float(built, tmp_path):
    """int8-static and int8-qat (built from the fused graph): every weight product runs as one
    `MatMulIntegerToFloat` or `DynamicQuantizeMatMul` (no output requantization, no `QLinearMatMul`), attention
    as `QAttention` on a calibrated scale (the readout layer's as float `MultiHeadAttention`), and only the
    products read the uint8-rounded activations: the residual path and
    the other float ops read the float tensor."""
    import onnx
    import onnxruntime as ort

    from pipeline.variants.onnx_census import INTEGER_OPS

    for name in ("int8-static", "int8-qat"):
        path = built["dirs"][name] / "model.onnx"
        graph = onnx.load(str(path)).graph
        producer = {o: n for n in graph.node for o in n.output}
        for node in graph.node:
            if node.op_type in ("MatMul", "Gemm", "Gather", "QuantizeLinear", "DequantizeLinear"):
                continue
            for i in node.input:
                dq = producer.get(i)
                if dq is not None and dq.op_type == "DequantizeLinear":  # only the embedding Gather's pair is kept
                    assert producer[producer[dq.input[0]].input[0]].op_type == "Gather", (name, node.name)
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node]
        floats = {"QLinearMatMul", "FusedMatMul", "Attention"} & set(ops)
        assert not floats, (name, sorted(ops))
        assert ops.count("QAttention") == 1 and ops.count("MultiHeadAttention") == 1, (name, ops)
        assert "DynamicQuantizeLinear" not in ops and ops.count("SkipLayerNormalization") == 4, (name, ops)
        # The head (pooler, classifier: one row each) is float on float weights (`head_matmuls`): two float
        # products, every other weight product an INT8 kernel, and no weight dequantized at run time.
        head = ops.count("MatMul") + ops.count("Gemm") + ops.count("FusedGemm")
        assert head == 2 and sum(ops.count(op) for op in INTEGER_OPS) == 10, (name, sorted(ops))
        assert ops.count("DequantizeLinear") == 3, (name, sorted(ops))  # the embedding gathers' only
