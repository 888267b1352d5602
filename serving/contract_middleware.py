"""The request contract in front of MLflow's scoring app, as ASGI middleware (`ContractMiddleware`).

MLflow's app (`mlflow.pyfunc.scoring_server`) would parse a body with Python's `json` first (no size or depth
limit, NaN and 10**5000 accepted, a deep body a 500, errors that echo the input) and encode the answer again; the
middleware holds the contract of `pipeline.deployment.protocol` instead, and skips that round trip:

- only `POST /invocations`, `GET /ping|/health|/version|/ready|/metrics` are answered (405/404 otherwise; `HEAD`
  wherever `GET`); MLflow's app answers `/ping`, `/health` and `/version` (a body it labels JSON that is none,
  such as `/ping`'s, goes out as `text/plain`);
- URL and header sizes are bounded (414/431; uvicorn's h11 parser refuses far larger ones itself);
- the body is read up to `package.max_body_bytes` (413 beyond, from Content-Length or while reading), then
  parsed and checked exactly as TorchServe's handler does, with MLflow's shapes (`dataframe_split`,
  `dataframe_records`, `inputs`, `instances`, CSV); only the checked texts are scored (`serving.scoring_queue`),
  and the answer is MLflow's: `{"predictions": [{"label", "score"}, ...]}`;
- failures are classified: the caller's mistake is a 4xx; a request that passed the contract and still failed
  is the server's (a model failure is 500, never MLflow's own 400 "unexpected error while evaluating the model"),
  more than `max_in_flight` requests at once are answered 503 with `Retry-After`, a scoring call past MLflow's
  request timeout 504; no error body ever quotes the input;
- a body must be all in within `body_timeout_s` (else 408, the connection closed), and a body being uploaded takes
  no scoring slot: `max_in_flight` counts requests whose body is in and not yet scored, so uploads that stall,
  and clients that read none of their answers, cannot make every other client's request a 503. Bodies over
  `PARSE_INLINE_BYTES` are parsed in a worker thread, not on the event loop;
- `Expect: 100-continue` with a declared length over the limit is answered 413 at once, the body never asked for;
  a request framed by both `Content-Length` and `Transfer-Encoding` is a 400; both close the connection;
- every answer carries `X-Model-Version`, `X-Model-Variant` and `X-Request-Id` (`serving.request_ids`), and every
  error body is `{"error", "status", "request_id"}`; the server's log lines name the request id;
- `/metrics` is Prometheus text (`serving.endpoint_metrics`); `/ready` scores one review (readiness).

Every field is touched on the event loop only (one loop: no lock between a check and its update).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.deployment.media_types import encoding_refused, is_json_media_type
from pipeline.deployment.protocol import (
    MLFLOW_SHAPES,
    REQUEST_ID_HEADER,
    VARIANT_HEADER,
    VERSION_HEADER,
    Limits,
    ParsedRequest,
    RequestError,
    error_body,
    rounded_score,
    server_error,
)
from pipeline.deployment.request_parsing import parse_request
from serving.endpoint_metrics import CLIENT_CLOSED, MODEL_BUSY, MODEL_ERROR, NOT_READY, Metrics, Outcome
from serving.protocol_answers import RETRY_AFTER_S, answered_by_protocol
from serving.request_bodies import ClientGone, read_body
from serving.request_ids import request_id
from serving.request_line import CLOSE, INVOCATIONS, ROUTES, read_origin_form, refusal, waits_for_continue
from serving.request_line import unsent_body_closes as closes_unsent
from serving.scoring_queue import READINESS, ScoringQueue

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

#: Seconds a request may take to send its body before it is answered 408 and closed (`--body-timeout`; nginx's
#: `client_body_timeout` in serving/nginx.conf bounds each read to 10 s).
BODY_TIMEOUT_S = 30.0
#: Bodies larger than this are parsed and checked in a worker thread instead of on the event loop.
PARSE_INLINE_BYTES = 64 * 1024
#: Scoring requests answered at once (`--max-in-flight`); one more is a 503 with Retry-After.
MAX_IN_FLIGHT = 64


@dataclass
class ContractMiddleware:
    """ASGI middleware holding the request contract in front of MLflow's scoring app (see the module doc).

    At most `max_in_flight` scoring requests whose body is in are answered at once (checked and scored); one more
    is answered 503 with `Retry-After`, before its body is read when the limit is already reached as it arrives.
    Reading a body takes no slot and must end within `body_timeout_s` (else 408), so stalled uploads cannot hold
    the slots valid requests need. `score` runs on the model's thread, a batch at a time, `timeout_s` at most a
    call (`serving.scoring_queue`)."""

    app: App
    score: Callable[[list[str]], list[Any]]
    limits: Limits
    version: str
    variant: str
    metrics: Metrics
    timeout_s: float  # seconds one scoring call may take before its requests are answered 504 (MLflow's timeout)
    max_in_flight: int = MAX_IN_FLIGHT
    body_timeout_s: float = BODY_TIMEOUT_S
    _in_flight: int = field(default=0, init=False)
    _scoring: ScoringQueue = field(init=False)

    def __post_init__(self) -> None:
        self._scoring = ScoringQueue(self.score, self.timeout_s)

    def model_headers(self, rid: str | None = None) -> Headers:
        headers = [(VERSION_HEADER.lower().encode(), self.version.encode()),
                   (VARIANT_HEADER.lower().encode(), self.variant.encode())]
        return [*headers, (REQUEST_ID_HEADER.lower().encode(), rid.encode())] if rid else headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: passed on to MLflow's app
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = request_id(scope)  # the protocol names a request it answers itself by the same id
        read_origin_form(scope)
        send = unless_answered_by_protocol(scope, send)
        try:
            outcome = await self._answer(scope, receive, send, rid)
        except Exception:
            if answered_by_protocol(scope):
                return  # what failed was the answer to a closed connection: the protocol's 400 is the answer
            log.exception("request %s: answering %s %s failed", rid, scope.get("method"), scope.get("path"))
            outcome = Outcome(500, "server_error")
            await self._json(send, 500, server_error(rid).body, rid)
        if answered_by_protocol(scope):
            return  # the connection's protocol answered this request itself (a 400 mid-body) and counted it
        path = scope.get("path", "")
        self.metrics.observe(path if path in ROUTES else "other", scope.get("method", ""), outcome,
                             time.perf_counter() - start)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, rid: str) -> Outcome:
        """Answer one HTTP request: its line and headers checked (`refusal`), then routed."""
        refused = refusal(scope)
        if refused is not None:
            return await self._error(send, refused[0], rid, closes_unsent(scope, refused[1]))
        path = scope.get("path", "")
        if scope.get("method") == "HEAD":  # answered as its GET, headers only
            scope, send = {**scope, "method": "GET"}, headers_only(send)
        if path == "/metrics":
            body, content_type = self.metrics.exposition()
            await self._send(send, 200, body, content_type, rid)
            return Outcome(200)
        if path == "/ready":
            return await self._ready(send, rid)
        if path != INVOCATIONS:
            return await self._forward(scope, send, rid)
        return await self._invocations(scope, receive, send, rid)

    async def _invocations(self, scope: Scope, receive: Receive, send: Send, rid: str) -> Outcome:
        """`POST /invocations`: a slot, the body, the contract's checks, the texts scored, MLflow's answer."""
        if self._in_flight >= self.max_in_flight:  # refused before its body is read
            return await self._overloaded(send, rid, closes_unsent(scope))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if (coding := encoding_refused(headers)) is not None:  # before the body is read, as the handler does
            return await self._error(send, coding, rid, closes_unsent(scope))
        try:
            parsed = await self._parsed(headers, receive, waiting := waits_for_continue(scope))
        except RequestError as err:
            # a 408's body, and a 413's that the client waits to be invited to send, are not read
            close = err.status == 408 or (err.status == 413 and waiting)
            return await self._error(send, err, rid, [CLOSE] if close else None,
                                     CLIENT_CLOSED if isinstance(err, ClientGone) else None)
        if self._in_flight >= self.max_in_flight:  # the slots filled while this body was read
            return await self._overloaded(send, rid)
        self._in_flight += 1
        self.metrics.in_flight.inc()
        try:
            status, predictions, _ = await self._scoring.scored(parsed.texts, rid)
        finally:
            # the slot is free before the answer goes out: a client that does not read its answers holds its
            # connection (until the server's send timeout), never a scoring slot
            self._in_flight -= 1
            self.metrics.in_flight.dec()
        if status != 200:
            return await self._failed(send, status, rid)
        answer = [{**p, "score": rounded_score(p["score"])}
                  if isinstance(p, dict) and isinstance(p.get("score"), int | float) else p
                  for p in predictions]  # as TorchServe's handler answers (`format_predictions`); another
        # pyfunc's records pass as it answers them
        await self._send(send, 200, json.dumps({"predictions": answer}).encode(), "application/json", rid)
        return Outcome(200, None, len(parsed.texts))

    async def _parsed(self, headers: dict[str, str], receive: Receive, waiting: bool) -> ParsedRequest:
        """The body read (`_body`) and checked as TorchServe's handler checks it (its Content-Encoding already)."""
        body = await read_body(headers, receive, self.limits.max_body_bytes, self.body_timeout_s, waiting)
        request = functools.partial(parse_request, body, self.limits, headers.get("content-type"), MLFLOW_SHAPES,
                                    content_encoding=headers.get("content-encoding"))
        # a large body's checks take a while: in a thread, so the event loop goes on serving the others
        return request() if len(body) <= PARSE_INLINE_BYTES else await asyncio.to_thread(request)

    async def _overloaded(self, send: Send, rid: str, extra: Headers | None = None) -> Outcome:
        log.warning("request %s: %d scoring requests in flight, the limit: answered 503", rid, self._in_flight)
        return await self._retry_later(send, rid, f"the server is answering {self._in_flight} requests, its limit",
                                       "overloaded", extra=extra)

    async def _retry_later(self, send: Send, rid: str, why: str, kind: str,
                           more: dict[str, Any] | None = None, extra: Headers | None = None) -> Outcome:
        """A 503 with `Retry-After`: `why`, when to try again (`more`: the body's other fields, `extra`: headers)."""
        await self._json(send, 503, {"error": f"{why}; retry after {RETRY_AFTER_S} s", "status": 503,
                                     "request_id": rid, **(more or {})},
                         rid, [(b"retry-after", str(RETRY_AFTER_S).encode()), *(extra or [])])
        return Outcome(503, kind)

    async def _failed(self, send: Send, status: int, rid: str) -> Outcome:
        """The contract's answer to a request that passed it and then failed (`status`: 504 when scoring timed out,
        503 while a call that did is still running, else 500): the server's failure, never the caller's (MLflow's
        own app answers a model that raised with 400)."""
        if status == 504:
            await self._json(send, 504, {"error": "scoring this request took longer than the server's timeout",
                                         "status": 504, "request_id": rid}, rid)
            return Outcome(504, "timeout")
        if status == 503:
            return await self._retry_later(send, rid, "the model is still busy with a call that timed out", MODEL_BUSY)
        await self._json(send, 500, server_error(rid).body, rid)
        return Outcome(500, MODEL_ERROR)

    async def _ready(self, send: Send, rid: str) -> Outcome:
        """200 with the model when one review goes through it, else the contract's 503 with `Retry-After`."""
        status, _, detail = await self._scoring.ready()
        served = {"version": self.version, "variant": self.variant}
        if status == 200:
            await self._json(send, 200, {"status": "ready", **served}, rid)
            return Outcome(200)
        log.warning("request %s: not ready (%s's call: %d: %s)", rid, READINESS, status, detail)
        # the model's own exception stays in the log: its text may name server paths and is any length
        why = ("the model failed on the readiness review (logged on the server with its request id)" if status == 500
               else detail or str(status))
        return await self._retry_later(send, rid, f"the model is not ready ({why})", NOT_READY, served)

    async def _call_app(self, scope: Scope) -> tuple[int, bytes, Headers]:
        """MLflow's app on one bodiless request: status, body (an error's kept to 2 KB: it may quote input), headers."""
        start: Message = {}
        parts: list[bytes] = []
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # the body was consumed: as a client that keeps the connection open
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                if start.get("status") == 200 or sum(map(len, parts)) < 2048:
                    parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        return int(start.get("status", 500)), b"".join(parts), list(start.get("headers", []))

    async def _forward(self, scope: Scope, send: Send, rid: str) -> Outcome:
        """Run MLflow's app (its GET paths); a 200 goes out with the model headers, anything else becomes the
        contract's JSON error (MLflow's own error bodies may quote the input and be any size)."""
        status, answer, headers = await self._call_app(scope)
        if status != 200:  # MLflow's own GET route failed: said as such, with MLflow's status in the log only
            log.error("request %s: %s failed inside MLflow's scoring app (%d): %s", rid, scope.get("path"), status,
                      answer[:300].decode("utf-8", "replace"))
            await self._json(send, 500, {"error": f"{scope.get('path')} failed inside MLflow's scoring app (logged on "
                                                  "the server with its request id)", "status": 500,
                                         "request_id": rid}, rid)
            return Outcome(500, "server_error")
        headers = [h for h in headers if h[0].lower() != b"server"]
        if not labelled_truly(headers, answer):  # MLflow labels `/ping`'s "\n" and `/version`'s "3.17.0" JSON
            headers = [(k, PLAIN_TEXT if k.lower() == b"content-type" else v) for k, v in headers]
        await send({"type": "http.response.start", "status": 200, "headers": [*headers, *self.model_headers(rid)]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})
        return Outcome(200)

    async def _error(self, send: Send, err: RequestError, rid: str, extra: Headers | None = None,
                     kind: str | None = None) -> Outcome:
        await self._json(send, err.status, {**error_body(err), "request_id": rid}, rid, extra)
        return Outcome(err.status, kind)

    async def _json(self, send: Send, status: int, body: dict[str, Any], rid: str,
                    extra: Headers | None = None) -> None:
        await self._send(send, status, json.dumps(body).encode(), "application/json", rid, extra)

    async def _send(self, send: Send, status: int, body: bytes, content_type: str, rid: str,
                    extra: Headers | None = None) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                   *self.model_headers(rid), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


#: The media type of a body MLflow's app labels JSON that is no JSON.
PLAIN_TEXT = b"text/plain; charset=utf-8"


def labelled_truly(headers: Headers, body: bytes) -> bool:
    """Whether an answer of MLflow's app is what its Content-Type says, as far as JSON goes: a body labelled
    `application/json` must parse as JSON (a client that trusts the label calls a JSON parser on it)."""
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if not is_json_media_type(content_type.decode("latin-1")):
        return True
    try:
        json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return True


def unless_answered_by_protocol(scope: Scope, send: Send) -> Send:
    """`send` that drops what the app sends once the protocol has answered the request itself. The protocol can
    answer before the app's task first runs: a request whose headers and unreadable body framing arrive in one read
    is refused while the app is still scheduled, and the app's own answer (a 404 or 405 that needs no body) would
    then meet a connection h11 has closed, an error and a 500 logged for every such request."""
    async def guarded_send(message: Message) -> None:
        if not answered_by_protocol(scope):
            await send(message)

    return guarded_send


def headers_only(send: Send) -> Send:
    """`send` for a HEAD request: the answer's start as it is, its body empty (uvicorn sends none for HEAD)."""
    async def headers_only_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            await send(message)
        elif not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return headers_only_send

