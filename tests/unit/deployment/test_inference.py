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


def test_a_huge_text_is_cut_to_max_chars_before_tokenizing_and_scored_as_the_cut_text(tiny_model_dir):
    capped = SentimentPredictor(tiny_model_dir, max_chars=5000)
    huge = "a truly great film. " * 200_000  # 4 million characters
    encoded = capped.encode([huge, "short and fine"])
    assert [ids.tolist() for ids in encoded] == [ids.tolist() for ids in capped.encode([huge[:5000], "short and fine"])]
    expected = capped.predict([huge, "short and fine"])
    assert [(p.label, p.score) for p in capped.score(encoded)] == [(p.label, p.score) for p in expected]


def test_the_pyfunc_predictor_refuses_what_the_contract_refuses(tiny_model_dir):
    """`ContractPredictor` (what the MLflow pyfunc runs) answers like `SentimentPredictor` on texts and refuses a
    value MLflow's DataFrame may hold instead of scoring its `str()` (null once came back as a label)."""
    import math

    import pytest

    from pipeline.deployment.inference import ContractPredictor
    from pipeline.deployment.protocol import RequestError

    checked = ContractPredictor(tiny_model_dir, max_chars=100, max_texts=3)
    texts = ["great wonderful film", "awful boring film"]
    assert [(p.label, p.score) for p in checked.predict(texts)] == \
        [(p.label, p.score) for p in SentimentPredictor(tiny_model_dir).predict(texts)]
    for values, needle in (([None], "got null"), ([math.nan], "got null"), ([5], "got a number"),
                           (["  "], "whitespace"), (["\u200b\u202e"], "no visible character"),
                           (["x" * 101], "more than the limit of 100"), (["a"] * 4, "maximum of 3"), ([], "no texts")):
        with pytest.raises(RequestError, match=needle):
            checked.predict(values)


def test_every_servable_format_names_the_packages_its_mlflow_model_needs():
    from pipeline.deployment.inference import runtime_requirements
    from pipeline.runtimes.catalog import VARIANTS

    for fmt in {v.format for v in VARIANTS if v.servable}:
        pins = runtime_requirements(fmt)
        assert pins[0].startswith("mlflow==") and all("==" in p for p in pins), fmt
    assert any(p.startswith("openvino==") for p in runtime_requirements("openvino"))
