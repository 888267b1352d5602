"""GPU: the TensorRT fp16 engine from the tiny model's fp32-onnx, built and checked for parity where the
`tensorrt` package imports (skipped, with the reason, where it does not)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import ExportParams
from pipeline.runtimes.base import pad_batch
from pipeline.runtimes.catalog import directories
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.tensorrt import TensorRTRunner
from pipeline.variants.export import run_export
from pipeline.variants.tensorrt import availability, build_engine, profile_shapes
from tests.factories import write_tokenized

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp32_onnx(tmp_path_factory, tiny_model_dir):
    ok, reason = availability()
    if not ok:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("trt")
    tok = write_tokenized(root / "tokenized", {"train": 16, "val": 16, "test": 16})
    run_export(finetuned=tiny_model_dir, tokenized=tok, variants_root=root / "variants",
               params=ExportParams(parity_samples=8))
    return directories(root / "variants")["fp32-onnx"]


def test_fp16_engine_matches_onnxruntime(tmp_path, fp32_onnx):
    shapes = profile_shapes(1, 4, 8, 8, 32, 64)
    info = build_engine(fp32_onnx / "model.onnx", tmp_path / "model.engine", shapes, "fp16")
    assert info["precision"] == "fp16"
    rng = np.random.default_rng(0)
    ids, mask = pad_batch([rng.integers(1000, 2000, size=n) for n in (8, 20, 33, 64)])
    got = TensorRTRunner(tmp_path / "model.engine")(ids, mask)
    ref = OrtRunner(fp32_onnx / "model.onnx")(ids, mask)
    assert np.abs(got - ref).max() < 5e-2
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75



def test_an_engine_answers_concurrent_calls_as_calls_alone(tmp_path, fp32_onnx):
    """Eight threads call one `TensorRTRunner` at once, each batch of its own shape: each call borrows an execution
    context and stream of its own, so every answer equals the same batch run alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    shapes = profile_shapes(1, 4, 8, 8, 32, 64)
    build_engine(fp32_onnx / "model.onnx", tmp_path / "model.engine", shapes, "fp16")
    runner = TensorRTRunner(tmp_path / "model.engine")
    rng = np.random.default_rng(1)
    batches = [pad_batch([rng.integers(1000, 2000, size=int(n)) for n in rng.integers(8, 65, size=1 + i % 4)])
               for i in range(16)]
    alone = [runner(ids, mask) for ids, mask in batches]
    barrier = threading.Barrier(8)

    def call(i: int) -> np.ndarray:
        if i < 8:
            barrier.wait()
        return runner(*batches[i % len(batches)])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, range(64)))
    for i, logits in enumerate(got):
        np.testing.assert_allclose(logits, alone[i % len(batches)], atol=1e-3, err_msg=f"call {i}")
    assert 1 <= runner.contexts.created <= 8
