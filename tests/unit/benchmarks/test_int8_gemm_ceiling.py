"""Unit: `benchmarks.int8_gemm_ceiling`: its single-node graphs compute the product they claim."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.machine import cpu_flags, resolve_weight_format


@pytest.mark.parametrize("weight_format", ["s8", "s7", "u8"])
def test_gemm_ceiling_products_compute_the_same_product(weight_format):
    """The three single-node graphs of `benchmarks.int8_gemm_ceiling` compute x @ W in their arithmetic, with
    weights in each format the pipeline can resolve to (so the INT8 kernel timed is the variants' one)."""
    import onnxruntime as ort
    from onnx import load_from_string, numpy_helper

    from benchmarks.int8_gemm_ceiling import single_node_model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    out = {}
    for kind in ("fp32", "int8"):
        blob = single_node_model(kind, 32, 16, weight_format)
        out[kind] = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w = numpy_helper.to_array(load_from_string(single_node_model("fp32", 32, 16)).graph.initializer[0])
    np.testing.assert_allclose(out["fp32"], x @ w, rtol=1e-5, atol=1e-5)
    # exact kernels (s7 and u8 everywhere, s8 with VNNI/AMX; AVX2's vpmaddubsw saturates s8 pairs)
    exact_kernel = weight_format != "s8" or resolve_weight_format("auto", cpu_flags()).value == "s8"  # this CPU's
    if exact_kernel:
        assert np.abs(out["int8"] - out["fp32"]).max() < 0.05 * np.abs(out["fp32"]).max()  # quantization error only
    xu = rng.integers(0, 256, (8, 32)).astype(np.uint8)
    blob = single_node_model("int8-gemm-only", 32, 16, weight_format)
    weight, _, zero = load_from_string(blob).graph.initializer
    w8 = numpy_helper.to_array(weight)
    assert w8.dtype == (np.uint8 if weight_format == "u8" else np.int8)
    got = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": xu})[0]
    if exact_kernel:
        expected = (xu.astype(np.int64) - 128) @ (w8.astype(np.int64) - int(numpy_helper.to_array(zero)))
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="unknown kind"):
        single_node_model("fp16", 4, 4)
