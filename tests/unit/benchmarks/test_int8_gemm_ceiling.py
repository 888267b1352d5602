"""Unit: `benchmarks.int8_gemm_ceiling`: its single-node graphs compute the product they claim."""

from __future__ import annotations

import numpy as np
import pytest


def test_gemm_ceiling_products_compute_the_same_product():
    """The three single-node graphs of `benchmarks.int8_gemm_ceiling` compute x @ W in their arithmetic."""
    import onnxruntime as ort
    from onnx import load_from_string, numpy_helper

    from benchmarks.int8_gemm_ceiling import single_node_model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    out = {}
    for kind in ("fp32", "int8"):
        blob = single_node_model(kind, 32, 16)
        out[kind] = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w = numpy_helper.to_array(load_from_string(single_node_model("fp32", 32, 16)).graph.initializer[0])
    np.testing.assert_allclose(out["fp32"], x @ w, rtol=1e-5, atol=1e-5)
    assert np.abs(out["int8"] - out["fp32"]).max() < 0.05 * np.abs(out["fp32"]).max()  # quantization error only
    xu = rng.integers(0, 256, (8, 32)).astype(np.uint8)
    blob = single_node_model("int8-gemm-only", 32, 16)
    w8 = numpy_helper.to_array(load_from_string(blob).graph.initializer[0]).astype(np.int64)
    got = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": xu})[0]
    np.testing.assert_array_equal(got, (xu.astype(np.int64) - 128) @ w8)  # 7-bit weights: exact
    with pytest.raises(ValueError, match="unknown kind"):
        single_node_model("fp16", 4, 4)
