"""Unit: `SentimentPredictor`, the serving code path, on the built variants."""

from __future__ import annotations

import numpy as np

from pipeline.deployment.inference import SentimentPredictor, softmax


def test_predictor_on_the_fp32_exports_answers_as_the_eager_model(built, tiny_model_dir):
    """The FP32 exports through the serving path give the eager model's answers (the INT8 variants' agreement with
    FP32 is tests/model's); a variant handed no texts answers none."""
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
    tokenizer, seen = capped.tokenizer, []

    class Spy:  # the tokenizer, recording the length of every text it is handed
        def __call__(self, texts: list[str], **kwargs: object) -> object:
            seen.extend(len(t) for t in texts)
            return tokenizer(texts, **kwargs)

        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

    capped.tokenizer = Spy()
    encoded = capped.encode([huge, "short and fine"])
    assert seen and max(seen) <= 5000  # the tokenizer never sees the 4-million-character text
    assert [ids.tolist() for ids in encoded] == [ids.tolist() for ids in capped.encode([huge[:5000], "short and fine"])]
    expected = capped.predict([huge, "short and fine"])
    assert [(p.label, p.score) for p in capped.score(encoded)] == [(p.label, p.score) for p in expected]


def test_the_pyfunc_predictor_refuses_what_is_not_a_review_and_scores_any_number_of_rows(tiny_model_dir):
    """`ContractPredictor` (what the MLflow pyfunc runs) answers like `SentimentPredictor` on texts and refuses a
    value MLflow's DataFrame may hold instead of scoring its `str()` (null once came back as a label), naming the
    row. How many rows and how long a text are the servers' limits, not the model's: 300 rows and a text longer
    than `max_chars` are scored (the long one cut, head and tail, as the served model cuts it)."""
    import math

    import pytest

    from pipeline.deployment.inference import ContractPredictor
    from pipeline.deployment.protocol import RequestError

    checked = ContractPredictor(tiny_model_dir, max_chars=100)
    plain = SentimentPredictor(tiny_model_dir, max_chars=100)
    texts = ["great wonderful film", "awful boring film"]
    assert [(p.label, p.score) for p in checked.predict(texts)] == [(p.label, p.score) for p in plain.predict(texts)]
    for values, needle in (([None], r"text\[0\] must be a string, got null"), (["ok", math.nan], r"text\[1\].*null"),
                           ([5], "got a number"), (["  "], "whitespace"), (["\u200b\u202e"], "no visible character"),
                           (["ok", "\ufffd"], r"text\[1\] holds no visible"), (["<br/><BR >"], "line-break markup")):
        with pytest.raises(RequestError, match=needle):
            checked.predict(values)
    assert checked.predict([]) == []
    # visible only in the middle that the cut to 100 characters leaves out: nothing of what the model reads
    for hidden in ("\u200b" * 60 + "a wonderful film" + "\u200b" * 200, "\ufffd \u2800" * 30 + "fine" + " \u00a0" * 90):
        with pytest.raises(RequestError, match=r"text\[1\] has \d+ characters and nothing to score in the 100"):
            checked.predict(["ok", hidden])
    many = [f"review {i}: " + ("great " if i % 2 else "awful ") * (1 + i % 37) for i in range(300)] + ["x" * 101]
    got = checked.predict(many)
    assert len(got) == len(many)
    alone = [plain.predict([t])[0] for t in many]
    assert [p.label for p in got] == [p.label for p in alone]
    assert np.allclose([p.score for p in got], [p.score for p in alone], atol=1e-4)


def test_predict_scores_a_long_input_in_bounded_chunks_in_input_order(tiny_model_dir, monkeypatch):
    """More texts than a chunk: tokenized chunk by chunk, batches of at most `max_batch`, answers in input order."""
    predictor = SentimentPredictor(tiny_model_dir, max_batch=8)
    monkeypatch.setattr(SentimentPredictor, "CHUNK_TEXTS", 20)
    batches: list[int] = []
    runner = predictor.runner
    predictor.runner = lambda ids, mask: (batches.append(len(ids)), runner(ids, mask))[1]
    chunks: list[int] = []
    encode = predictor.encode
    predictor.encode = lambda texts: (chunks.append(len(texts)), encode(texts))[1]
    texts = [("great " if i % 3 else "awful ") * (1 + (i * 7) % 30) + str(i) for i in range(50)]
    got = predictor.predict(texts)
    assert chunks == [20, 20, 10]  # tokenized a chunk at a time, never all 50 at once
    assert max(batches) <= 8 and sum(batches) == 50
    expected = [predictor.predict([t])[0] for t in texts]
    assert [p.label for p in got] == [p.label for p in expected]
    assert np.allclose([p.score for p in got], [p.score for p in expected], atol=1e-5)


def test_score_never_runs_a_forward_pass_larger_than_max_batch(tiny_model_dir):
    """`score` is what TorchServe's handler calls with every surviving request of a frontend batch at once (8
    requests of up to `package.max_texts` texts each): however many token-id sequences it is handed, it runs
    padded batches of at most `max_batch` sequences of similar length, and answers in input order as if each
    were scored alone."""
    from pipeline.deployment.batch_answers import answer_batch
    from pipeline.deployment.protocol import Limits
    from pipeline.deployment.request_parsing import RawRequest

    predictor = SentimentPredictor(tiny_model_dir, max_batch=8)
    shapes: list[tuple[int, int]] = []
    runner = predictor.runner
    predictor.runner = lambda ids, mask: (shapes.append(ids.shape), runner(ids, mask))[1]
    texts = [("great " if i % 3 else "awful ") * (1 + (i * 11) % 40) + str(i) for i in range(37)]
    encoded = predictor.encode(texts)
    got = predictor.score(encoded)
    assert max(rows for rows, _ in shapes) <= 8 and sum(rows for rows, _ in shapes) == len(texts)
    # sorted by length: the padded cells are fewer than one batch of all 37 padded to the longest
    assert sum(rows * cols for rows, cols in shapes) < len(texts) * max(len(ids) for ids in encoded)
    expected = [predictor.score([ids])[0] for ids in encoded]
    assert [p.label for p in got] == [p.label for p in expected]
    assert np.allclose([p.score for p in got], [p.score for p in expected], atol=1e-5)

    import json

    shapes.clear()
    requests = [RawRequest(json.dumps({"texts": texts[i::4]}).encode(), "application/json") for i in range(4)]
    limits = Limits(max_texts=64, max_body_bytes=1_000_000, max_chars_per_text=20_000, max_json_depth=8)
    answers = answer_batch(requests, predictor, limits, "m")
    assert [a.status for a in answers] == [200] * 4
    assert shapes and max(rows for rows, _ in shapes) <= 8


def test_every_servable_format_names_the_packages_its_mlflow_model_needs():
    from pipeline.deployment.mlflow_model import runtime_requirements
    from pipeline.runtimes.catalog import VARIANTS

    for fmt in {v.format for v in VARIANTS if v.servable}:
        pins = runtime_requirements(fmt)
        assert pins[0].startswith("mlflow==") and all("==" in p for p in pins), fmt
    assert any(p.startswith("openvino==") for p in runtime_requirements("openvino"))


def test_a_variant_needs_transformers_only_where_its_tokenizer_does(built, tmp_path):
    """The ONNX and OpenVINO variants tokenize with `tokenizers` alone; a directory without `tokenizer.json`
    loads its tokenizer through transformers, so its requirements name it."""
    from pipeline.deployment.mlflow_model import runtime_requirements

    def names(fmt, directory):
        return {p.split("==")[0] for p in runtime_requirements(fmt, directory)}

    assert "transformers" not in names("onnx", built["dirs"]["int8-dynamic"]) | names(
        "openvino", built["dirs"]["int8-openvino"])
    assert "transformers" in names("onnx", tmp_path) and "transformers" in names("eager", None)


def test_a_pyfunc_row_error_names_the_callers_row_label_where_the_index_has_labels():
    """A bad row of a DataFrame indexed `[2, 1, 0]` is `text[2]` by position; the error also names its label 0, the
    one `df.loc` finds (with the default index, position and label agree and the message is left as it is)."""
    import pandas as pd

    from pipeline.deployment.mlflow_model import labelled

    message = "text[2] must be a string, got null"
    assert labelled(message, pd.Index([2, 1, 0])) == "text[2] (the row labelled 0) must be a string, got null"
    assert labelled(message, pd.RangeIndex(3)) == message
    assert labelled(message, pd.Index(["a", "b", "c"])).startswith("text[2] (the row labelled 'c')")
    assert labelled("input needs a column named 'text'", pd.Index([5])) == "input needs a column named 'text'"


def test_freezing_the_loaded_objects_keeps_them_out_of_every_later_collection():
    """What a server holds once loaded is moved out of the collector's generations, so a request's own garbage
    never makes a collection walk it (the servers call this after their warm-up)."""
    import gc

    from pipeline.deployment.inference import freeze_loaded_objects

    held = [[i] for i in range(10_000)]  # a loaded model's many small objects
    try:
        freeze_loaded_objects()
        assert gc.get_freeze_count() >= len(held)
        assert not any(gc.is_tracked(x) and x in gc.get_objects(generation=2) for x in held[:3])
    finally:
        gc.unfreeze()
