"""Serving: whose fault a failure is. `serving.mlflow_server.ContractMiddleware` in front of MLflow's real scoring
app (`mlflow.pyfunc.scoring_server`) for a pyfunc that fails: MLflow answers a model that raised with 400
"unexpected error while evaluating the model"; the contract had accepted the request, so the caller gets a 500
with a request id, the log names it, and `/metrics` counts a server-side `model_error`. Too many requests at
once are a 503 with Retry-After; the caller's own mistakes stay 4xx."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pandas as pd
import pytest

from pipeline.deployment.protocol import Limits
from serving.mlflow_server import ContractMiddleware, Metrics


class Failing:
    """A pyfunc body that raises on the review "boom" and answers every other one."""

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if (model_input["text"] == "boom").any():
            raise RuntimeError("the model broke on this batch")
        return pd.DataFrame({"label": ["positive"] * len(model_input), "score": [0.9] * len(model_input)})


@pytest.fixture(scope="module")
def mlflow_app(tmp_path_factory):
    """MLflow's own scoring app for a saved pyfunc around `Failing`."""
    import mlflow
    from mlflow.pyfunc import PythonModel, scoring_server

    class Model(Failing, PythonModel):
        pass

    path = tmp_path_factory.mktemp("pyfunc") / "model"
    mlflow.pyfunc.save_model(str(path), python_model=Model())
    return scoring_server.init(mlflow.pyfunc.load_model(str(path)))


def middleware(app: Any, max_in_flight: int = 64) -> ContractMiddleware:
    return ContractMiddleware(app, Limits(max_texts=4), "3", "test-variant", Metrics("3", "test-variant"),
                              max_in_flight)


async def call(app: Any, body: bytes, headers: dict[str, str] | None = None,
               path: str = "/invocations", method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    """One request through an ASGI app; (status, headers, body)."""
    raw = [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **(headers or {})}.items()]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": raw, "http_version": "1.1"}
    sent = False
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["headers"], out["body"]


def metric(app: ContractMiddleware, name: str, **labels: str) -> float:
    text = app.metrics.exposition()[0].decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_model_failure_is_a_500_with_a_request_id_logged_and_counted_as_the_servers(mlflow_app, caplog):
    app = middleware(mlflow_app)
    ok = asyncio.run(call(app, json.dumps({"inputs": ["fine"]}).encode()))
    assert ok[0] == 200 and len(ok[1]["x-request-id"]) == 32
    with caplog.at_level(logging.ERROR, logger="serving.mlflow_server"):
        status, headers, body = asyncio.run(call(app, json.dumps({"inputs": ["fine", "boom"]}).encode(),
                                                 {"X-Request-Id": "client-id-42"}))
    assert status == 500, body
    answer = json.loads(body)
    assert answer["status"] == 500 and answer["request_id"] == "client-id-42" == headers["x-request-id"]
    assert "boom" not in body.decode()  # never the input
    assert any("client-id-42" in r.getMessage() and "model failed" in r.getMessage() for r in caplog.records)
    assert metric(app, "sentiment_request_errors_total", kind="model_error", side="server") == 1
    assert metric(app, "sentiment_request_errors_total", side="client") == 0


def test_the_callers_mistake_stays_a_4xx_and_an_unsafe_request_id_is_replaced(mlflow_app):
    app = middleware(mlflow_app)
    status, headers, body = asyncio.run(call(app, json.dumps({"inputs": [None]}).encode(),
                                             {"X-Request-Id": "bad id\r\nSet-Cookie: x"}))
    assert status == 400 and json.loads(body)["request_id"] == headers["x-request-id"]
    assert headers["x-request-id"] != "bad id\r\nSet-Cookie: x" and len(headers["x-request-id"]) == 32
    assert metric(app, "sentiment_request_errors_total", kind="invalid_input", side="client") == 1
    assert metric(app, "sentiment_request_errors_total", side="server") == 0


def test_more_requests_than_the_limit_at_once_get_a_503_with_retry_after(mlflow_app):
    release = asyncio.Event()

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await mlflow_app(scope, receive, send)

    app = middleware(slow_app, max_in_flight=2)

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


def test_concurrent_requests_are_scored_together_and_a_failing_one_fails_alone(mlflow_app):
    """Requests that arrive while the model is busy go to MLflow's app as one batch; when that batch fails, each
    request is scored alone, so only the one the model fails on gets a 500."""
    calls: list[int] = []  # texts per call of MLflow's app

    async def counting_app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        calls.append(len(json.loads(message["body"])["dataframe_split"]["data"]))
        await asyncio.sleep(0.02)  # a forward pass: the other requests queue meanwhile

        async def again() -> Any:
            return message

        await mlflow_app(scope, again, send)

    app = middleware(counting_app)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        bodies = [json.dumps({"inputs": ["boom" if i == 4 else f"fine {i}", "good"]}).encode() for i in range(8)]
        return await asyncio.gather(*(call(app, b) for b in bodies))

    answers = asyncio.run(scenario())
    assert [a[0] for a in answers] == [200, 200, 200, 200, 500, 200, 200, 200]
    assert all(len(json.loads(a[2])["predictions"]) == 2 for i, a in enumerate(answers) if i != 4)
    assert max(calls) > 2  # texts of several requests went to the model in one call
    assert calls.count(2) >= 8  # and after that batch failed, each request alone
    assert metric(app, "sentiment_request_errors_total", kind="model_error", side="server") == 1
