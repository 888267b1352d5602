"""The TorchServe handler without TorchServe: one server-side batch is scored in one forward pass, each answer
goes back to its own request, a bad request gets its own 4xx, and the batch size is logged (the serving tier's
batching check reads that line from the real server's log)."""

from __future__ import annotations

import json
import logging

import pytest

from pipeline.deployment.inference import SentimentPredictor
from serving.handler import SentimentHandler
from tests import factories


class Context:
    """What the handler uses of TorchServe's context: each request's headers (its Content-Type), and per-request
    response statuses and headers."""

    def __init__(self, content_types: list[str]) -> None:
        self.content_types = content_types
        self.statuses: dict[int, int] = {}
        self.headers: dict[int, dict[str, str]] = {}

    def get_all_request_header(self, idx: int) -> dict[str, object]:
        return {"Content-Type": self.content_types[idx]}

    def get_request_id(self, idx: int = 0) -> str:
        return f"ts-request-{idx}"

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        assert value == "application/json"

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.headers.setdefault(idx, {})[key] = value


class CountingPredictor:
    """The real predictor, counting how many texts each forward pass received."""

    def __init__(self, predictor: SentimentPredictor) -> None:
        self.predictor, self.calls = predictor, []

    def encode(self, texts):
        return self.predictor.encode(texts)

    def score(self, encoded):
        self.calls.append(len(encoded))
        return self.predictor.score(encoded)


def test_a_batch_is_scored_in_one_call_mapped_back_and_its_size_logged(tiny_model_dir, caplog):
    predictor = SentimentPredictor(tiny_model_dir)
    handler = SentimentHandler()
    handler.predictor = CountingPredictor(predictor)
    handler.limits = factories.limits(max_texts=4, max_body_bytes=2048)
    handler.model_label = "imdb-sentiment:v1/test"
    handler.headers = {"X-Model-Version": "1", "X-Model-Variant": "test"}
    handler.initialized = True
    batch = [
        {"body": json.dumps({"text": "a wonderful film"}).encode()},
        {"body": b'{"text": 42}'},  # a bad request in the middle of the batch
        {"data": {"texts": ["awful", "boring plot"]}},  # TorchServe's decoded JSON, under "data"
        {"body": b"plain text review"},
    ]
    context = Context(["application/json", "application/json", "application/json", "text/plain"])
    with caplog.at_level(logging.INFO, logger="serving.handler"):
        answers = [json.loads(a) for a in handler.handle(batch, context)]
    assert "batch of 4 requests" in caplog.text
    assert handler.predictor.calls == [4]  # the 4 texts of the 3 good requests, scored together
    assert context.statuses == {0: 200, 1: 400, 2: 200, 3: 200}
    # errors too name the model, and every answer its request id (TorchServe's)
    assert all(context.headers[i] == {**handler.headers, "X-Request-Id": f"ts-request-{i}"} for i in range(4))
    assert answers[1]["status"] == 400 and "must be a string" in answers[1]["error"]
    assert answers[1]["request_id"] == "ts-request-1"
    expected = predictor.predict(["a wonderful film", "awful", "boring plot", "plain text review"])
    got = [answers[0], *answers[2], answers[3]]
    assert [g["label"] for g in got] == [e.label for e in expected]
    assert [g["score"] for g in got] == pytest.approx([e.score for e in expected], abs=1e-5)
    assert all(g["model"] == "imdb-sentiment:v1/test" for g in got)


def test_a_context_that_cannot_give_a_requests_headers_is_a_logged_500_not_the_clients_415(tiny_model_dir, caplog):
    """TorchServe's context failing to hand over the headers is a server fault: each request of the batch gets the
    contract's 500 with its id and the traceback is logged, instead of a 415 telling the client it sent none."""

    class Headless(Context):
        def get_all_request_header(self, idx: int) -> dict[str, object]:
            raise IndexError("no request properties")

    handler = SentimentHandler()
    handler.predictor = SentimentPredictor(tiny_model_dir)
    handler.limits = factories.limits(max_texts=4, max_body_bytes=2048)
    handler.initialized = True
    context = Headless(["application/json"] * 2)
    with caplog.at_level(logging.ERROR, logger="serving.handler"):
        answers = [json.loads(a) for a in handler.handle([{"body": b'{"text": "fine"}'}] * 2, context)]
    assert context.statuses == {0: 500, 1: 500}
    assert [a["request_id"] for a in answers] == ["ts-request-0", "ts-request-1"]
    assert any(r.exc_info and isinstance(r.exc_info[1], IndexError) for r in caplog.records)
