"""Unit: `SentimentPredictor`, the serving code path, on the built variants."""

from __future__ import annotations

import numpy as np

from pipeline.deployment.inference import SentimentPredictor, softmax


def test_predictor_on_every_runnable_variant(built, tiny_model_dir):
    texts = ["great wonderful film", "awful boring film", "ok"]
    ref = SentimentPredictor(tiny_model_dir).predict(texts)
    for name in ("fp32-torchscript", "fp32-onnx"):
        got = SentimentPredictor(built["dirs"][name]).predict(texts)
        assert [p.label for p in got] == [p.label for p in ref]
        assert np.allclose([p.score for p in got], [p.score for p in ref], atol=1e-4)
    assert SentimentPredictor(built["dirs"]["int8-static"]).predict([]) == []


def test_softmax_is_stable():
    p = softmax(np.array([[1000.0, 0.0], [0.0, 0.0]]))
    assert np.allclose(p, [[1.0, 0.0], [0.5, 0.5]])
