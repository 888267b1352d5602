"""Serving: whose fault a failure is. `serving.contract_middleware.ContractMiddleware` over a real saved pyfunc that
fails (`pipeline.deployment.mlflow_model.served_model`: MLflow's scoring app and the pyfunc's `predict`): the
contract had accepted the request, so a model that raised is a 500 (MLflow's own app says 400 "unexpected error
while evaluating the model") with a request id, the log names it, and `/metrics` counts a server-side
`model_error`; a scoring call past the timeout is a 504. Too many requests at once are a 503 with Retry-After; the
caller's own mistakes stay 4xx. A client that does not finish sending its body in time gets a 408, and while
it is still sending it takes no slot from the requests that have arrived."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest

from pipeline.deployment.mlflow_model import ServedModel, served_model
from serving import contract_middleware, request_bodies
from serving.contract_middleware import ContractMiddleware
from serving.endpoint_metrics import Metrics
from tests import factories


class Failing:
    """A pyfunc body that raises on the review "boom" and answers every other one."""

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if (model_input["text"] == "boom").any():
            raise RuntimeError("the model broke on this batch")
        return pd.DataFrame({"label": ["positive"] * len(model_input), "score": [0.9] * len(model_input)})


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> ServedModel:
    """A saved pyfunc around `Failing`, loaded for serving."""
    import mlflow
    from mlflow.pyfunc import PythonModel

    class Model(Failing, PythonModel):
        pass

    path = tmp_path_factory.mktemp("pyfunc") / "model"
    mlflow.pyfunc.save_model(str(path), python_model=Model())
    return served_model(str(path), tracking_uri=None)


def middleware(served: ServedModel, score: Callable[[list[str]], list[Any]] | None = None, max_in_flight: int = 64,
               timeout_s: float | None = None,
               body_timeout_s: float = contract_middleware.BODY_TIMEOUT_S) -> ContractMiddleware:
    return ContractMiddleware(served.app, score or served.score, factories.limits(max_texts=4), "3", "test-variant",
                              Metrics("3", "test-variant"), timeout_s=timeout_s or served.timeout_s,
                              max_in_flight=max_in_flight, body_timeout_s=body_timeout_s)


async def call(app: Any, body: bytes, headers: dict[str, Any] | list[tuple[str, Any]] | None = None,
               path: str = "/invocations", method: str = "POST",
               receive: Any = None, before_send: Any = None,
               http_version: str = "1.1") -> tuple[int, dict[str, str], bytes]:
    """One request through an ASGI app; (status, headers, body). `headers` as a list sends a name as often as it
    appears there, a value as bytes goes as those bytes (else UTF-8); `receive` replaces the client's side of the
    body (by default `body` in one message, then a client that keeps the connection open); `before_send` is awaited
    with each message the app sends, before it goes out (a client that reads nothing: one that never returns)."""
    pairs = [("content-type", "application/json"), *headers] if isinstance(headers, list) else \
        list({"content-type": "application/json", **(headers or {})}.items())
    raw = [(k.lower().encode(), v if isinstance(v, bytes) else v.encode()) for k, v in pairs]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": raw, "http_version": http_version}
    sent = False
    out: dict[str, Any] = {"body": b""}

    async def whole_body() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if before_send is not None:
            await before_send(message)
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive or whole_body, send)
    return out["status"], out["headers"], out["body"]


def metric(app: ContractMiddleware, name: str, **labels: str) -> float:
    text = app.metrics.exposition()[0].decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_model_failure_is_a_500_with_a_request_id_logged_and_counted_as_the_servers(served, caplog):
    app = middleware(served)
    ok = asyncio.run(call(app, json.dumps({"inputs": ["fine"]}).encode()))
    assert ok[0] == 200 and len(ok[1]["x-request-id"]) == 32
    with caplog.at_level(logging.ERROR, logger="serving"):
        status, headers, body = asyncio.run(call(app, json.dumps({"inputs": ["fine", "boom"]}).encode(),
                                                 {"X-Request-Id": "client-id-42"}))
    assert status == 500, body
    answer = json.loads(body)
    assert answer["status"] == 500 and answer["request_id"] == "client-id-42" == headers["x-request-id"]
    assert "boom" not in body.decode()  # never the input
    assert answer == torchserve_500("client-id-42")  # the body TorchServe's handler answers a model that raised
    assert any("client-id-42" in r.getMessage() and "model failed" in r.getMessage() for r in caplog.records)
    # the traceback is in the server's log, not only the exception's first line
    assert any(r.exc_info and "the model broke" in str(r.exc_info[1]) for r in caplog.records)
    assert metric(app, "sentiment_request_errors_total", kind="model_error", side="server") == 1
    assert metric(app, "sentiment_request_errors_total", side="client") == 0


def torchserve_500(request_id: str) -> dict[str, Any]:
    """What TorchServe's handler (`answer_batch`) answers a request whose scoring raised, named `request_id`."""
    import numpy as np

    from pipeline.deployment.batch_answers import answer_batch
    from pipeline.deployment.protocol import Limits
    from pipeline.deployment.request_parsing import RawRequest

    class Raising:
        def encode(self, texts: list[str]) -> list[np.ndarray]:
            return [np.array([1, 2]) for _ in texts]

        def score(self, encoded: list[np.ndarray]) -> list[Any]:
            raise RuntimeError("the model failed")

    limits = Limits(max_texts=64, max_body_bytes=1_000_000, max_chars_per_text=20_000, max_json_depth=8)
    (answer,) = answer_batch([RawRequest(b'{"text": "fine"}', "application/json")], Raising(), limits, "m",
                             [request_id])
    assert answer.status == 500
    return answer.body


def test_the_callers_mistake_stays_a_4xx_and_an_unsafe_request_id_is_replaced(served):
    app = middleware(served)
    status, headers, body = asyncio.run(call(app, json.dumps({"inputs": [None]}).encode(),
                                             {"X-Request-Id": "bad id\r\nSet-Cookie: x"}))
    assert status == 400 and json.loads(body)["request_id"] == headers["x-request-id"]
    assert headers["x-request-id"] != "bad id\r\nSet-Cookie: x" and len(headers["x-request-id"]) == 32
    assert metric(app, "sentiment_request_errors_total", kind="invalid_input", side="client") == 1
    assert metric(app, "sentiment_request_errors_total", side="server") == 0


def test_more_requests_than_the_limit_at_once_get_a_503_with_retry_after(served):
    release = threading.Event()

    def slow(texts: list[str]) -> list[Any]:
        release.wait(10)
        return served.score(texts)

    app = middleware(served, slow, max_in_flight=2)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        body = json.dumps({"inputs": ["fine"]}).encode()
        first = [asyncio.create_task(call(app, body)) for _ in range(2)]
        await asyncio.sleep(0.05)  # both are in flight, waiting on the model
        refused = await call(app, body)
        release.set()
        return [refused, *await asyncio.gather(*first)]

    refused, *answered = asyncio.run(scenario())
    assert refused[0] == 503 and refused[1]["retry-after"] == "1" and json.loads(refused[2])["status"] == 503
    assert [a[0] for a in answered] == [200, 200]
    assert metric(app, "sentiment_request_errors_total", kind="overloaded", side="server") == 1
    assert metric(app, "sentiment_requests_in_flight") == 0


def test_concurrent_requests_are_scored_together_and_a_failing_one_fails_alone(served):
    """Requests that arrive while the model is busy are scored in one call; when that batch fails, each request is
    scored alone, so only the one the model fails on gets a 500."""
    calls: list[int] = []  # texts per call of the model

    def counting(texts: list[str]) -> list[Any]:
        calls.append(len(texts))
        time.sleep(0.02)  # a forward pass: the other requests queue meanwhile
        return served.score(texts)

    app = middleware(served, counting)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        bodies = [json.dumps({"inputs": ["boom" if i == 4 else f"fine {i}", "good"]}).encode() for i in range(8)]
        return await asyncio.gather(*(call(app, b) for b in bodies))

    answers = asyncio.run(scenario())
    assert [a[0] for a in answers] == [200, 200, 200, 200, 500, 200, 200, 200]
    assert all(len(json.loads(a[2])["predictions"]) == 2 for i, a in enumerate(answers) if i != 4)
    assert max(calls) > 2  # texts of several requests went to the model in one call
    assert calls.count(2) >= 8  # and after that batch failed, each request alone
    assert metric(app, "sentiment_request_errors_total", kind="model_error", side="server") == 1


def test_a_scoring_call_past_the_timeout_is_a_504_and_the_server_goes_on(served, caplog):
    stuck = threading.Event()
    calls: list[list[str]] = []

    def slow(texts: list[str]) -> list[Any]:
        calls.append(list(texts))
        if "slow" in texts:
            stuck.wait(5)
        return served.score(texts)

    app = middleware(served, slow, timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="serving"):
        status, headers, body = asyncio.run(call(app, json.dumps({"inputs": ["slow"]}).encode()))
    assert status == 504 and json.loads(body)["request_id"] == headers["x-request-id"], body
    assert any(headers["x-request-id"] in r.getMessage() and "timed out" in r.getMessage() for r in caplog.records)
    assert metric(app, "sentiment_request_errors_total", kind="timeout", side="server") == 1
    # while the timed-out call still runs (a thread cannot be stopped), nothing queues behind it: neither the
    # request nor the readiness probe reaches the model, both are answered 503 while it is still stuck
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serving"):
        busy = asyncio.run(call(app, json.dumps({"inputs": ["fine"]}).encode()))
        ready = asyncio.run(call(app, b"", path="/ready", method="GET"))
    assert calls == [["slow"]] and not stuck.is_set()
    # a 503 while the model is busy is no model failure: a warning, not an error that says the model failed
    assert caplog.records and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert busy[0] == 503 and busy[1]["retry-after"] == "1" and "busy" in json.loads(busy[2])["error"], busy
    not_ready = json.loads(ready[2])  # the contract's error, with the served model and Retry-After
    assert ready[0] == 503 and ready[1]["retry-after"] == "1" and not_ready["status"] == 503, ready
    assert not_ready["error"].startswith("the model is not ready") and not_ready["variant"] == "test-variant"
    assert not_ready["request_id"] == ready[1]["x-request-id"]
    assert metric(app, "sentiment_request_errors_total", kind="model_busy", side="server") == 1
    assert metric(app, "sentiment_request_errors_total", kind="not_ready", side="server") == 1
    assert metric(app, "sentiment_request_errors_total", kind="overloaded") == 0  # neither is load shedding
    stuck.set()
    deadline = time.monotonic() + 5
    while (answer := asyncio.run(call(app, json.dumps({"inputs": ["fine"]}).encode())))[0] == 503:
        assert time.monotonic() < deadline, answer
        time.sleep(0.02)
    assert answer[0] == 200
    assert asyncio.run(call(app, b"", path="/ready", method="GET"))[0] == 200


def test_a_model_that_raises_on_the_readiness_review_is_not_ready_without_its_exception_in_the_answer(served,
                                                                                                       caplog):
    """The model's exception text may name server paths and be any length: the 503 says the model failed and where
    the detail is (the log, under the request id), in a bounded body."""
    secret = "could not open /srv/models/variant/model.onnx: " + "\u00e9" * 400

    def broken(texts: list[str]) -> list[Any]:
        raise RuntimeError(secret)

    app = middleware(served, broken)
    with caplog.at_level(logging.WARNING, logger="serving"):
        status, headers, body = asyncio.run(call(app, b"", path="/ready", method="GET"))
    answer = json.loads(body)
    assert status == 503 and headers["retry-after"] == "1" and len(body) <= 512, body
    assert "/srv/models" not in answer["error"] and "failed on the readiness review" in answer["error"]
    assert any(headers["x-request-id"] in r.getMessage() and "/srv/models" in r.getMessage() for r in caplog.records)


def test_ping_version_and_ready_answer_with_the_model_headers(served):
    app = middleware(served)
    for path in ("/ping", "/health", "/version", "/ready"):
        status, headers, _ = asyncio.run(call(app, b"", path=path, method="GET"))
        assert status == 200 and headers["x-model-variant"] == "test-variant", path


def test_a_refused_body_is_read_to_its_end_before_the_413_so_the_client_can_read_it(served):
    """uvicorn closes a connection whose body was left unread: a client still writing would get a reset, not
    the 413. So the rest of a refused body (up to a bound) is read before the answer starts."""
    app = middleware(served)
    chunk = b"x" * 65536
    chunks = 40  # 2.6 MB, over the 1 MB default limit
    events: list[str] = []

    async def scenario() -> int:
        sent = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            sent += 1
            events.append("read")
            return {"type": "http.request", "body": chunk, "more_body": sent < chunks}

        async def send(message: dict[str, Any]) -> None:
            events.append(message["type"])
            if message["type"] == "http.response.start":
                status.append(message["status"])

        status: list[int] = []
        scope = {"type": "http", "method": "POST", "path": "/invocations", "raw_path": b"/invocations",
                 "query_string": b"", "http_version": "1.1", "headers": [(b"content-type", b"application/json")]}
        await app(scope, receive, send)
        return status[0]

    assert asyncio.run(scenario()) == 413
    assert events.count("read") == chunks and events.index("http.response.start") > events.index("read") + chunks - 1


def test_a_complete_body_refused_after_reading_is_answered_without_reading_again(served):
    """Too many texts is a 413 found after the whole body was read: nothing is left to drain, so the body is not
    waited for again (a second `receive` would block until the client hangs up)."""
    app = middleware(served)
    reads: list[int] = []
    body = json.dumps({"inputs": ["fine"] * 5}).encode()

    async def receive() -> dict[str, Any]:
        reads.append(1)
        if len(reads) > 1:
            await asyncio.Event().wait()
        return {"type": "http.request", "body": body, "more_body": False}

    status, _, _ = asyncio.run(asyncio.wait_for(call(app, body, receive=receive), 30))
    assert status == 413 and len(reads) == 1


def stalling() -> Callable[[], Any]:
    """`receive` of a client that sends the start of its body once and then nothing, keeping the connection."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": b'{"inputs": ["fi', "more_body": True}

    return receive


def test_a_body_not_in_within_the_timeout_is_a_408_that_closes_the_connection(served):
    app = middleware(served, body_timeout_s=0.3)
    # a hang fails the test (the body never ends: only the middleware's own timeout answers)
    status, headers, body = asyncio.run(asyncio.wait_for(
        call(app, b"", {"X-Request-Id": "slow-1"}, receive=stalling()), timeout=5))
    assert status == 408
    assert headers["connection"] == "close"  # the rest of the body is never read: the connection cannot be reused
    answer = json.loads(body)
    assert answer == {"error": "the request body did not arrive within 0.3 s (15 bytes received)", "status": 408,
                      "request_id": "slow-1"}
    assert metric(app, "sentiment_request_errors_total", kind="request_timeout", side="client") == 1


def test_uploads_still_arriving_take_no_scoring_slot(served):
    """With one scoring slot, three clients stalled in their uploads do not make a complete request a 503 (before,
    every upload held a slot from its first byte: as many stalled clients as `--max-in-flight` refused everyone)."""
    app = middleware(served, max_in_flight=1, body_timeout_s=1.0)

    async def scenario() -> tuple[tuple[int, dict[str, str], bytes], list[tuple[int, dict[str, str], bytes]]]:
        stalled = [asyncio.create_task(call(app, b"", receive=stalling())) for _ in range(3)]
        await asyncio.sleep(0.05)  # all three are reading their bodies
        valid = await call(app, json.dumps({"inputs": ["fine"]}).encode())
        return valid, list(await asyncio.gather(*stalled))

    valid, stalled = asyncio.run(scenario())
    assert valid[0] == 200 and json.loads(valid[2])["predictions"][0]["label"] == "positive"
    assert [s[0] for s in stalled] == [408, 408, 408]
    assert metric(app, "sentiment_requests_in_flight") == 0


def test_a_refused_body_trickled_without_end_is_not_waited_for(served, monkeypatch):
    """A 413's body is read and dropped for at most `DISCARD_WAIT_S` in all, however the client paces it."""
    monkeypatch.setattr(request_bodies, "DISCARD_WAIT_S", 0.3)
    app = middleware(served)

    async def trickle() -> dict[str, Any]:
        await asyncio.sleep(0.02)  # a byte at a time, each well inside any per-read timeout
        return {"type": "http.request", "body": b"x", "more_body": True}

    status, _, body = asyncio.run(asyncio.wait_for(  # the trickle never ends: waiting on it would hang here
        call(app, b"", {"Content-Length": "1000001"}, receive=trickle), timeout=5))
    assert status == 413 and json.loads(body)["status"] == 413


def test_concurrent_readiness_probes_share_one_scoring_call(served):
    """`/ready` scores a review through the model; probes that arrive while one is scoring wait for that call
    instead of adding their own, so a flood of probes cannot multiply the model's work."""
    calls: list[list[str]] = []
    release = threading.Event()

    def counting(texts: list[str]) -> list[Any]:
        calls.append(texts)
        release.wait(10)
        return served.score(texts)

    app = middleware(served, counting)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        probes = [asyncio.create_task(call(app, b"", path="/ready", method="GET")) for _ in range(20)]
        await asyncio.sleep(0.1)  # all twenty are waiting on the first probe's call
        release.set()
        return list(await asyncio.gather(*probes))

    answers = asyncio.run(scenario())
    assert [a[0] for a in answers] == [200] * 20 and len(calls) == 1
    assert {json.loads(a[2])["status"] for a in answers} == {"ready"}
    assert asyncio.run(call(app, b"", path="/ready", method="GET"))[0] == 200 and len(calls) == 2  # the next one scores


def test_an_answer_the_client_does_not_read_holds_no_scoring_slot(served):
    """With one scoring slot, a request whose answer cannot go out (a client that reads nothing: uvicorn's send
    waits for the buffer to drain, until the server's send timeout drops the connection) leaves the slot to the
    next request: the slot is freed once the answer is known, before it is sent."""
    app = middleware(served, max_in_flight=1)
    stuck = asyncio.Event()

    async def never_drains(message: dict[str, Any]) -> None:
        stuck.set()
        await asyncio.Event().wait()

    async def scenario() -> tuple[int, dict[str, str], bytes]:
        blocked = asyncio.create_task(call(app, json.dumps({"inputs": ["unread"]}).encode(),
                                           before_send=never_drains))
        await asyncio.wait_for(stuck.wait(), 10)  # its answer is being sent, and stays so
        answered = await call(app, json.dumps({"inputs": ["fine"]}).encode())
        blocked.cancel()
        return answered

    status, _, body = asyncio.run(scenario())
    assert status == 200, body
    assert json.loads(body)["predictions"][0]["label"] == "positive"


class Upload:
    """The client's side of a body sent at once in 64 KiB messages, as `call`'s `receive`: `size` bytes, or with no
    `size` one that never ends; `reads` counts what the app read of it, `pieces` how many messages it takes."""

    PIECE = 64 * 1024

    def __init__(self, size: int | None = None) -> None:
        self.pieces, self.reads = (None if size is None else -(-size // self.PIECE)), 0

    async def __call__(self) -> dict[str, Any]:
        self.reads += 1
        more = self.pieces is None or self.reads < self.pieces
        return {"type": "http.request", "body": b"x" * self.PIECE, "more_body": more}


def test_an_oversized_body_the_client_waits_to_be_invited_to_send_is_refused_unread(served):
    """`Expect: 100-continue` with a declared length over the limit: a 413 that closes the connection, and the body
    is never read (uvicorn answers "100 Continue" on the first read, which would ask for the whole upload)."""
    app = middleware(served)
    upload = Upload()
    status, headers, body = asyncio.run(call(app, b"", {"Content-Length": "5000000", "Expect": "100-continue"},
                                             receive=upload))
    assert status == 413 and headers["connection"] == "close" and upload.reads == 0
    assert json.loads(body)["status"] == 413


@pytest.mark.parametrize(("path", "method", "extra", "status"), [
    ("/nope", "POST", {}, 404), ("/invocations", "PUT", {}, 405),
    ("/invocations", "POST", {"Content-Encoding": "gzip"}, 415),
    ("/invocations", "POST", {"X-Pad": "a" * 70_000}, 431)])
def test_any_answer_before_a_held_back_body_closes_the_connection(served, path, method, extra, status):
    """A client waiting for "100 Continue" and answered before its body is read never sends that body, so the
    connection's next bytes would be read as it: every such answer says `Connection: close` (before, only a 413 did,
    and the next request on the connection was answered 400)."""
    app = middleware(served)
    upload = Upload()
    got, headers, _ = asyncio.run(call(app, b"", {"Content-Length": "27", "Expect": "100-continue", **extra},
                                       path=path, method=method, receive=upload))
    assert got == status and headers.get("connection") == "close" and upload.reads == 0
    got, headers, _ = asyncio.run(call(app, b"", {"Content-Length": "27", **extra}, path=path, method=method))
    assert got == status and "connection" not in headers  # no body held back: the connection stays usable


@pytest.mark.parametrize("expect", [[("Expect", "100-continue"), ("Expect", "foo")],
                                    [("Expect", "foo"), ("Expect", "100-continue")],
                                    [("Expect", "100-continue, foo")], [("Expect", "FOO ,100-Continue")]],
                         ids=["continue-then-other", "other-then-continue", "one-line", "one-line-reversed"])
def test_any_expectation_but_100_continue_is_a_417_before_the_body_however_it_is_sent(served, expect):
    """A client that sends two `Expect` lines, or two expectations on one, was invited to upload (h11 answers
    "100 Continue" when any of them is 100-continue) and its body read when the other came last: every expectation
    counts, and one this server cannot meet is a 417 with nothing read."""
    app = middleware(served)
    upload = Upload()
    status, headers, _ = asyncio.run(call(app, b"", [("Content-Length", "5000000"), *expect], receive=upload))
    assert (status, headers["connection"], upload.reads) == (417, "close", 0)
    for empty in ("", " , ", "100-continue,"):  # empty list elements are no expectation (RFC 9110 5.6.1)
        status, _, _ = asyncio.run(call(app, json.dumps({"inputs": ["fine"]}).encode(), {"Expect": empty}))
        assert status == 200, empty


def test_an_http_1_0_clients_expectation_is_ignored_so_its_refused_body_is_read_and_dropped(served):
    """RFC 9110 10.1.1: a server ignores 100-continue from an HTTP/1.0 client (h11 does not answer it), which sends
    its body at once. Its oversized body is read and dropped before the 413, as any client's, so it can read the
    answer instead of a reset; the same request over HTTP/1.1 is refused unread and closed."""
    app = middleware(served)
    size = app.limits.max_body_bytes + 1
    request = {"Content-Length": str(size), "Expect": "100-continue"}
    upload = Upload(size)
    status, headers, answer = asyncio.run(call(app, b"", request, receive=upload, http_version="1.0"))
    assert (status, upload.reads, "connection" in headers) == (413, upload.pieces, False), answer
    upload = Upload(size)
    status, headers, _ = asyncio.run(call(app, b"", request, receive=upload))
    assert (status, upload.reads, headers["connection"]) == (413, 0, "close")
    # the expectation read as the 417 reads it: every list element of every Expect line
    upload = Upload(size)
    status, _, _ = asyncio.run(call(app, b"", [("Content-Length", str(size)), ("Expect", "100-continue,")],
                                    receive=upload))
    assert (status, upload.reads) == (413, 0)


@pytest.mark.parametrize("version", ["2.0", "3.0", "9.9"])
def test_a_request_line_of_another_http_major_version_is_a_505_the_client_is_counted_for(served, version):
    """h11 reads any `HTTP/<digit>.<digit>` request line with HTTP/1.1 framing, so `HTTP/2.0` was answered as a
    1.1 request. It is a 505 now, as nginx in front of TorchServe answers it, and `/metrics` counts it on the
    client's side: a client sending such lines raises no server error rate. The connection is not closed at once
    (a body on its way is read and dropped, as after a 404). HTTP/0.x is a malformed line (400), as to nginx; a
    minor version above 1.1 is read as 1.1 (RFC 9112 2.3), with the Host header 1.1 requires."""
    app = middleware(served)
    body = json.dumps({"inputs": ["a fine film"]}).encode()
    host = [("Host", "t")]
    status, headers, answer = asyncio.run(call(app, body, host, http_version=version))
    error = json.loads(answer)
    assert (status, error["status"], "connection" in headers) == (505, 505, False), answer
    assert error["request_id"] == headers["x-request-id"]
    assert metric(app, "sentiment_request_errors_total", kind="http_version_not_supported", side="client") == 1
    assert metric(app, "sentiment_request_errors_total", side="server") == 0
    status, headers, _ = asyncio.run(call(app, body, host, http_version="0.9"))
    assert (status, headers["connection"]) == (400, "close")
    for accepted in ("1.0", "1.1", "1.2"):
        assert asyncio.run(call(app, body, host, http_version=accepted))[0] == 200, accepted
    status, headers, answer = asyncio.run(call(app, body, http_version="1.2"))  # no Host
    assert (status, headers["connection"]) == (400, "close"), answer


@pytest.mark.parametrize("space", [b"\xa0", b"\x85"])
def test_only_space_and_tab_surround_an_expectation_or_a_coding_or_a_media_type(served, space):
    """Header bytes 0xA0 and 0x85 (NBSP and NEL once read as latin-1, whitespace to `str.strip()`) are not optional
    whitespace: `Expect: 100-continue<NBSP>` is no 100-continue (h11 does not invite the body for it), a 417 with
    nothing read; `identity<NBSP>` is no coding the server takes and `application/json<NBSP>` no JSON: 415s."""
    app = middleware(served)
    upload = Upload()
    status, _, _ = asyncio.run(call(app, b"", [("Content-Length", "5000"), ("Expect", b"100-continue" + space)],
                                    receive=upload))
    assert (status, upload.reads) == (417, 0)
    body = json.dumps({"inputs": ["fine"]}).encode()
    assert asyncio.run(call(app, body, {"Content-Encoding": "identity \t", "content-type": "application/json\t"}))[
        0] == 200
    assert asyncio.run(call(app, body, {"Content-Encoding": b"identity" + space}))[0] == 415
    assert asyncio.run(call(app, body, {"content-type": b"application/json" + space}))[0] == 415
    # what TorchServe's Netty trims off a value's ends (0x1C-0x1F, VT, FF) is trimmed here too: the same answer
    assert asyncio.run(call(app, body, {"content-type": b"application/json\x1c", "Expect": b"100-continue\x1f",
                                        "Content-Encoding": b"\x0bidentity\x1e"}))[0] == 200


def test_an_absolute_form_target_counts_whole_against_the_url_limit(served):
    """`POST http://<50 KB of authority>/invocations` was read as its path before the URL was measured: scored,
    where the same length as a path is a 414."""
    from serving.request_line import MAX_URL_BYTES

    app = middleware(served)
    body = json.dumps({"inputs": ["fine"]}).encode()
    for target in ("http://" + "a" * MAX_URL_BYTES + "/invocations", "/invocations" + "/" * MAX_URL_BYTES):
        status, _, answer = asyncio.run(call(app, body, path=target))
        assert status == 414 and "URL of" in json.loads(answer)["error"], target[:40]
    status, _, _ = asyncio.run(call(app, body, path="http://127.0.0.1:5001/invocations"))
    assert status == 200


def test_a_request_framed_both_by_length_and_by_chunks_is_a_400_that_closes_the_connection(served):
    app = middleware(served)
    status, headers, body = asyncio.run(call(app, json.dumps({"inputs": ["a"]}).encode(),
                                             {"Content-Length": "2000000", "Transfer-Encoding": "chunked"}))
    assert status == 400 and headers["connection"] == "close"
    assert "Transfer-Encoding" in json.loads(body)["error"]


def test_a_large_body_is_checked_off_the_event_loop_and_answered(served, monkeypatch):
    """A body over `PARSE_INLINE_BYTES` is parsed and checked in a worker thread (a megabyte of JSON takes the
    checks a while, during which the event loop would serve no one); a small one on the loop, as before."""
    threads: list[str] = []
    parse = contract_middleware.parse_request

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return parse(*args, **kwargs)

    monkeypatch.setattr(contract_middleware, "parse_request", recording)
    app = middleware(served)
    small = json.dumps({"inputs": ["fine"]}).encode()
    large = small[:-1] + b" " * (contract_middleware.PARSE_INLINE_BYTES + 1) + b"}"
    for body in (small, large):
        status, _, answer = asyncio.run(call(app, body))
        assert status == 200 and json.loads(answer)["predictions"][0]["label"] == "positive"
    assert threads[0] == threading.main_thread().name and threads[1] != threading.main_thread().name


def test_a_scoring_call_that_never_returns_does_not_keep_a_stopped_server_alive(tmp_path):
    """The model's thread is a daemon: a process whose main thread ends exits though a call still runs there
    (a `ThreadPoolExecutor`'s worker is joined at exit, so a hung call kept the process until it was killed)."""
    import subprocess
    import sys

    script = ("import threading, time\n"
              "from serving.scoring_queue import ModelThread\n"
              "started = threading.Event()\n"
              "pool = ModelThread()\n"
              "first = pool.submit(lambda: 6 * 7)\n"
              "assert first.result(timeout=10) == 42\n"
              "pool.submit(lambda: (started.set(), time.sleep(600)))\n"
              "assert started.wait(10)\n"
              "print('main ends', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=factories.ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "main ends" in done.stdout, done.stderr[-2000:]


def test_a_readiness_probe_queues_with_the_requests_and_fails_none_of_them(served):
    """`/ready` scores its review in the queue the requests' batches go through: a probe that arrives while a batch is
    scoring waits its turn, and no call is timed while it waits for another (before, the probe went straight to the
    model beside the batches, and whichever waited behind the other ran out its timeout: a 503 to the probe, a 504
    to the next request, with no call slower than the timeout)."""
    def slow(texts: list[str]) -> list[Any]:
        time.sleep(0.3)
        return served.score(texts)

    app = middleware(served, slow, timeout_s=0.5)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        async def later(delay: float, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
            await asyncio.sleep(delay)
            return await call(app, **kwargs)

        body = json.dumps({"inputs": ["fine"]}).encode()
        return await asyncio.gather(call(app, body), later(0.05, body=b"", path="/ready", method="GET"),
                                    later(0.1, body=body))

    first, ready, second = asyncio.run(scenario())
    assert (first[0], ready[0], second[0]) == (200, 200, 200), (first, ready, second)
    assert json.loads(ready[2])["status"] == "ready"
    assert metric(app, "sentiment_request_errors_total", kind="timeout", side="server") == 0


def test_a_client_that_hangs_up_mid_body_is_counted_as_gone_not_as_invalid_input(served):
    """A client that closed the connection before its body was in gets no answer to read: `/metrics` counts it as
    `client_closed` (nginx's 499), not as a malformed request."""
    app = middleware(served)
    parts = iter([{"type": "http.request", "body": b'{"inputs": ["fi', "more_body": True}, {"type": "http.disconnect"}])

    async def hang_up() -> dict[str, Any]:
        return next(parts)

    status, _, _ = asyncio.run(call(app, b"", receive=hang_up))
    assert status == 400
    assert metric(app, "sentiment_request_errors_total", kind="client_closed", side="client") == 1
    assert metric(app, "sentiment_request_errors_total", kind="invalid_input") == 0
