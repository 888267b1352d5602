"""MLflow's scoring server for the champion, behind the request contract: `python -m serving.mlflow_server`
(`make serve-mlflow`).

It loads `models:/<mlflow.registered_model_name>@<mlflow.champion_alias>` (or `--model-uri`) as a pyfunc and
serves it under uvicorn, in one process, through `ContractMiddleware` (ASGI): MLflow's own scoring app
(`mlflow.pyfunc.scoring_server`, what `mlflow models serve` runs) answers `/ping`, `/health` and `/version`, and
scoring goes to the pyfunc MLflow loaded (`served_model`: for this project's models, the predictor its `predict`
calls, on the checked texts, without the DataFrames around it; any other pyfunc through `PyFuncModel.predict`).
MLflow's app would parse a body with Python's `json` first (no size or depth limit,
NaN and 10**5000 accepted, a deep body a 500, errors that echo the input) and encode the answer again; the
middleware holds the contract of `pipeline.deployment.protocol` instead, and skips that round trip:

- only `POST /invocations`, `GET /ping|/health|/version|/ready|/metrics` are answered (405/404 otherwise);
- URL and header sizes are bounded (414/431; uvicorn's h11 parser refuses far larger ones itself);
- the body is read up to `package.max_body_bytes` (413 beyond, from Content-Length or while reading), then
  parsed and checked exactly as TorchServe's handler does, with MLflow's shapes (`dataframe_split`,
  `dataframe_records`, `inputs`, `instances`, CSV); only the checked texts reach the pyfunc, as a DataFrame of
  one `text` column (so pandas never re-reads a CSV review "NA" as missing), and the answer is MLflow's:
  `{"predictions": [{"label", "score"}, ...]}`;
- failures are classified: the caller's mistake is a 4xx; a request that passed the contract and still failed
  is the server's (a model failure is 500, never MLflow's own 400 "unexpected error while evaluating the model"),
  more than `--max-in-flight` requests at once are answered 503 with `Retry-After`, a scoring call past MLflow's
  request timeout (`MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`) 504; no error body ever quotes the input;
- slow clients hold nothing for long (one slow-HTTP "slowloris" connection holds nothing past its deadlines; many
  at once can fill `--limit-concurrency`, whose extra connections get a JSON 503 with `Retry-After` and are closed,
  so a per-client connection cap belongs to the proxy in front, docs/serving.md): a connection whose
  request line and headers have not all arrived within `--header-timeout` seconds of its opening (or of its last
  answer) is closed, with a 408 if a request had begun (`request_deadline_protocol`: uvicorn has no such timeout,
  and ASGI code only runs once the headers are in), and a body not complete within `--body-timeout` seconds is
  answered 408 and the connection closed. A body being uploaded takes no scoring slot: `--max-in-flight` counts
  requests whose body is in and not yet scored, so uploads that stall, and clients that read none of their answers,
  cannot make every other client's request a 503; a connection whose answers go unread for `--send-timeout`
  seconds is dropped. Bodies over `PARSE_INLINE_BYTES` are parsed in a worker thread, not on the event loop;
- `Expect: 100-continue` with a declared length over the limit is answered 413 at once, the body never asked for;
  a request framed by both `Content-Length` and `Transfer-Encoding` is a 400; both close the connection;
- every answer carries `X-Model-Version`, `X-Model-Variant` and `X-Request-Id` (the client's, when it sent a
  short safe one, else a new one); error bodies and the server's log lines name the request id;
- `/metrics` is Prometheus text (requests, latency histogram, errors by kind and by side: client or server,
  requests in flight); `/ready` scores one review through the pyfunc (readiness; probes that arrive
  together share one call);
- logs go to `<log-dir>/mlflow_server.log`, appended across restarts and rotated by size.

Concurrency: one process. uvicorn's event loop reads and checks requests; the checked texts of the requests that
arrive while the model is scoring go to it together in its next call, in a worker thread (server-side batching, as
TorchServe's frontend does, with no delay: a lone request goes at once), and each request gets its slice of the
predictions. Whatever per-call work remains is paid once per batch, and one
forward pass at a time uses the runtime's threads (all cores, or `package.threads`). Below that, the predictor also
merges calls from several threads (`pipeline.deployment.coalescing`) and every runtime lends each call what it
cannot share (`pipeline.runtimes.pool`), so the model is safe however it is called. Several processes would each
hold a copy of the model and split the cores between smaller forward passes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import json
import logging
import logging.config
import queue
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.deployment.coalescing import MAX_BATCH_TEXTS, take_oldest
from pipeline.deployment.protocol import (
    MLFLOW_SHAPES,
    REQUEST_ID_HEADER,
    SCORE_DECIMALS,
    VARIANT_HEADER,
    VERSION_HEADER,
    Limits,
    RequestError,
    error_body,
)
from pipeline.deployment.request_parsing import parse_request
from serving.request_deadline import PROTOCOL_REFUSED, RETRY_AFTER_S, request_deadline_protocol

log = logging.getLogger("serving.mlflow_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

INVOCATIONS = "/invocations"
#: Paths and the methods answered on them; everything else is 404 (unknown path) or 405 (other method).
ROUTES = {INVOCATIONS: "POST", "/ping": "GET", "/health": "GET", "/version": "GET", "/ready": "GET",
          "/metrics": "GET"}
MAX_URL_BYTES = 2048
MAX_HEADER_BYTES = 8192
#: uvicorn's h11 parser refuses a request line plus headers beyond this itself (a plain 400), before the app.
H11_MAX_HEADER_BYTES = 65536
READY_TEXT = "readiness probe: a fine film"
#: Error kinds by status, for `/metrics`: 4xx are the caller's, 5xx the server's (`side` label).
ERROR_KINDS = {400: "invalid_input", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
               413: "too_large", 414: "uri_too_long", 415: "unsupported_media_type", 431: "headers_too_large",
               417: "expectation_failed", 500: "server_error", 503: "overloaded", 504: "timeout"}
#: The kind of a 503 while the model is still busy with a call that timed out, and of a failed `/ready`.
MODEL_BUSY = "model_busy"
NOT_READY = "not_ready"
#: The kind of a 500 when the model (the pyfunc) failed on a request the contract had accepted.
MODEL_ERROR = "model_error"
#: A client's request id is echoed only when it is this short and plain (never a header or log injection).
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
#: A refused (413) body up to this size is read to its end before the answer, so the client can read the 413.
DISCARD_BODY_BYTES = 8 * 1024 * 1024
#: Seconds, in all, spent reading and dropping a refused body before answering anyway.
DISCARD_WAIT_S = 2.0
#: Seconds a connection may take to send a request's line and headers (from its opening or its last answer), and a
#: request its body, before the server answers 408 and closes it; `--header-timeout`/`--body-timeout` (nginx's
#: `client_header_timeout` and `client_body_timeout` in serving/nginx.conf are 10 and 30 s).
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
#: Seconds an answer may wait for a client that reads none of it (the connection's send buffer full) before the
#: connection is dropped; `--send-timeout` (nginx's `send_timeout` is 60 s).
SEND_TIMEOUT_S = 30.0
#: Bodies larger than this are parsed and checked in a worker thread instead of on the event loop.
PARSE_INLINE_BYTES = 64 * 1024
CLOSE = (b"connection", b"close")
#: Headers a request may send once only (lower-case, as uvicorn hands them over); a repeat is a 400.
SINGLE_HEADERS = frozenset({b"content-type", b"content-encoding"})
#: Scoring requests answered at once (`--max-in-flight`); one more is a 503 with Retry-After.
MAX_IN_FLIGHT = 64


class Metrics:
    """Prometheus metrics of the endpoint, in a registry of their own (`/metrics`)."""

    def __init__(self, version: str, variant: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("sentiment_requests", "Requests answered, by path, method and status",
                                ["path", "method", "status"], registry=self.registry)
        self.latency = Histogram("sentiment_request_latency_seconds", "Time to answer a request, by path",
                                 ["path"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.errors = Counter("sentiment_request_errors", "Requests answered with an error, by kind and by whose "
                              "fault it is (client: 4xx, server: 5xx)", ["kind", "side"], registry=self.registry)
        self.in_flight = Gauge("sentiment_requests_in_flight", "Scoring requests being answered now",
                               registry=self.registry)
        self.texts = Counter("sentiment_texts_scored", "Texts scored (valid requests answered 200)",
                             registry=self.registry)
        Gauge("sentiment_model_info", "The served model (always 1)", ["version", "variant"],
              registry=self.registry).labels(version, variant).set(1)

    def observe(self, path: str, method: str, outcome: Outcome, seconds: float) -> None:
        path = path if path in ROUTES else "other"  # unknown paths never become label values
        method = method if method in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS") else "other"
        status = outcome.status
        self.requests.labels(path, method, str(status)).inc()
        self.latency.labels(path).observe(seconds)
        if status >= 400:
            kind = outcome.kind or ERROR_KINDS.get(status, "server_error" if status >= 500 else "other")
            self.errors.labels(kind, "server" if status >= 500 else "client").inc()
        elif outcome.texts:
            self.texts.inc(outcome.texts)

    def refused(self, status: int, kind: str) -> None:
        """An answer the connection's protocol gave itself (`request_deadline_protocol`: a 408 for headers too slow, a
        400 for bytes that are no request or for a body in too many small pieces, a 503 past the connection limit):
        counted under path and method `other`, with no latency; a request the app had begun to read is then not
        counted by the app (`PROTOCOL_REFUSED`)."""
        self.requests.labels("other", "other", str(status)).inc()
        self.errors.labels(kind, "server" if status >= 500 else "client").inc()

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass(eq=False)
class _Pending:
    """A checked scoring request waiting for its batch: its texts, its id and where its answer goes."""

    texts: list[str]
    rid: str
    answer: asyncio.Future[tuple[int, list[Any] | None]]


def _log_failure(rid: str, status: int, detail: str) -> None:
    """The server log's line for a request the model failed (`status`: 504 timed out, else 500), with its id and
    the error's first line."""
    if status == 504:
        log.error("request %s: scoring timed out: %s", rid, detail)
    else:
        log.error("request %s: the model failed on a request the contract accepted: %s", rid, detail)


def _resolve(pending: _Pending, status: int, predictions: list[Any] | None) -> None:
    if not pending.answer.done():  # a client that went away cancelled its wait
        pending.answer.set_result((status, predictions))


@dataclass(frozen=True)
class Outcome:
    """How one request was answered: the status, the error kind where the status alone does not say it, and how
    many texts were scored."""

    status: int
    kind: str | None = None
    texts: int = 0


def request_id(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is short and plain (`SAFE_REQUEST_ID`), else a new random one."""
    for key, value in scope.get("headers", []):
        if key.lower() == REQUEST_ID_HEADER.lower().encode():
            sent = value.decode("latin-1")
            if SAFE_REQUEST_ID.fullmatch(sent):
                return sent
            break
    return uuid.uuid4().hex


class ModelThread:
    """One daemon thread that runs the model's calls in the order they are submitted, each answered through its
    `Future`. Not a `ThreadPoolExecutor`: Python joins that pool's threads at exit, so a scoring call that hangs
    (the case a 504 answers) would keep a stopped server's process alive until it is killed; a daemon thread ends
    with the process."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """`fn(*args)` on the model's thread (started on the first call)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, lambda: fn(*args)))
        with self._lock:
            if not self._thread.is_alive():
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            future, call = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # the caller's to judge: it answers 500 and logs it
                future.set_exception(exc)


@dataclass
class ContractMiddleware:
    """ASGI middleware holding the request contract in front of MLflow's scoring app (see the module doc).

    At most `max_in_flight` scoring requests whose body is in are answered at once (checked and scored); one more
    is answered 503 with `Retry-After`, before its body is read when the limit is already reached as it arrives.
    Reading a body takes no slot and must end within `body_timeout_s` (else 408), so stalled uploads cannot hold
    the slots valid requests need."""

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
    _queue: list[_Pending] = field(default_factory=list, init=False)
    _drainer: asyncio.Task[None] | None = field(default=None, init=False)
    _readiness: asyncio.Task[tuple[int, list[Any], str]] | None = field(default=None, init=False)
    #: The model's own thread: every call runs there, one at a time (the drainer sends one batch at a time anyway),
    #: so a call that hangs holds this thread, never the event loop's default pool that parses large bodies.
    _model_thread: ModelThread = field(default_factory=ModelThread, init=False)
    #: A call that timed out and is still running: until it ends, new calls are answered 503 at once instead of
    #: queueing behind it (the thread cannot be stopped).
    _timed_out: concurrent.futures.Future[Any] | None = field(default=None, init=False)

    def model_headers(self, rid: str | None = None) -> list[tuple[bytes, bytes]]:
        headers = [(VERSION_HEADER.lower().encode(), self.version.encode()),
                   (VARIANT_HEADER.lower().encode(), self.variant.encode())]
        return [*headers, (REQUEST_ID_HEADER.lower().encode(), rid.encode())] if rid else headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: passed on to MLflow's app
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = request_id(scope)
        try:
            outcome = await self._answer(scope, receive, send, rid)
        except Exception:
            log.exception("request %s: answering %s %s failed", rid, scope.get("method"), scope.get("path"))
            outcome = Outcome(500, "server_error")
            await self._json(send, 500, {"error": "internal error while answering this request (logged on "
                                                  "the server)", "status": 500, "request_id": rid}, rid)
        if (scope.get("state") or {}).get(PROTOCOL_REFUSED):
            return  # the connection's protocol answered this request itself (a 400 mid-body) and counted it
        self.metrics.observe(scope.get("path", ""), scope.get("method", ""), outcome, time.perf_counter() - start)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, rid: str) -> Outcome:
        """Answer one HTTP request."""
        path, method = scope.get("path", ""), scope.get("method", "")
        url_bytes = len(scope.get("raw_path") or path.encode()) + len(scope.get("query_string") or b"")
        if url_bytes > MAX_URL_BYTES:
            return await self._error(send, RequestError(414, f"URL of {url_bytes} bytes exceeds the limit of "
                                                             f"{MAX_URL_BYTES}"), rid)
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if header_bytes > MAX_HEADER_BYTES:
            return await self._error(send, RequestError(431, f"request headers of {header_bytes} bytes exceed "
                                                             f"the limit of {MAX_HEADER_BYTES}"), rid)
        if not (scope.get("raw_path") or path.encode()).startswith(b"/"):  # `%2Finvocations`, `*`: not a path
            return await self._error(send, RequestError(400, "the request target must be a path beginning with /"),
                                     rid, [CLOSE])
        allowed = ROUTES.get(path)
        if allowed is None:
            return await self._error(send, RequestError(404, "no such path; scoring is POST /invocations"), rid)
        if method != allowed and not (method == "HEAD" and allowed == "GET"):  # HEAD wherever GET (RFC 9110 9.3.2)
            methods = f"{allowed}, HEAD" if allowed == "GET" else allowed
            return await self._error(send, RequestError(405, f"method not allowed on this path; use {allowed}"),
                                     rid, [(b"allow", methods.encode())])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if (expect := headers.get("expect", "").strip().lower()) and expect != "100-continue":
            return await self._error(send, RequestError(417, "the only expectation this server meets is "
                                                             "100-continue"), rid, [CLOSE])
        if method == "HEAD":  # answered as its GET, headers only
            scope, send = {**scope, "method": "GET"}, headers_only(send)
        if path == "/metrics":
            body, content_type = self.metrics.exposition()
            await self._send(send, 200, body, content_type, rid)
            return Outcome(200)
        if path == "/ready":
            return Outcome(200) if await self._ready(send, rid) == 200 else Outcome(503, NOT_READY)
        if path != INVOCATIONS:
            return await self._forward(scope, b"", send, rid)
        if self._in_flight >= self.max_in_flight:  # refused before its body is read
            return await self._overloaded(send, rid)
        counts = collections.Counter(k for k, _ in scope.get("headers", []) if k in SINGLE_HEADERS)
        if repeated := sorted(k for k, n in counts.items() if n > 1):
            # two Content-Types (or codings): a proxy in front may have read the first while this server would read
            # the last, so the body would be checked as one thing and scored as another
            names = " and ".join(k.decode("latin-1").title() for k in repeated)
            return await self._error(send, RequestError(400, f"{names} sent more than once: send it once"), rid,
                                     [CLOSE])
        if "content-length" in headers and "transfer-encoding" in headers:
            # two framings (h11 reads the chunks, the length would size the body): a request-smuggling shape that no
            # honest client sends; answered and closed, its body unread
            return await self._error(send, RequestError(400, "both Content-Length and Transfer-Encoding: send "
                                                             "one of them"), rid, [CLOSE])
        try:
            body = await self._body(headers, receive)
            request = functools.partial(parse_request, body, self.limits, headers.get("content-type"), MLFLOW_SHAPES,
                                        content_encoding=headers.get("content-encoding"))
            # a large body's checks take a while: in a thread, so the event loop goes on serving the others
            parsed = request() if len(body) <= PARSE_INLINE_BYTES else await asyncio.to_thread(request)
        except RequestError as err:
            # a 408's body, and a 413's that the client waits to be invited to send, are not read
            close = err.status == 408 or (err.status == 413 and expects_continue(headers))
            return await self._error(send, err, rid, [CLOSE] if close else None)
        if self._in_flight >= self.max_in_flight:  # the slots filled while this body was read
            return await self._overloaded(send, rid)
        self._in_flight += 1  # one event loop: no lock needed between the check and the increment
        self.metrics.in_flight.inc()
        try:
            status, predictions = await self._scored(parsed.texts, rid)
        finally:
            # the slot is free before the answer goes out: a client that does not read its answers holds its
            # connection (until the server's send timeout), never a scoring slot
            self._in_flight -= 1
            self.metrics.in_flight.dec()
        if status != 200:
            return await self._failed(send, status, rid)
        answer = [{**p, "score": round(float(p["score"]), SCORE_DECIMALS)}
                  if isinstance(p, dict) and isinstance(p.get("score"), int | float) else p
                  for p in predictions or []]  # as TorchServe's handler answers (`format_predictions`); another
        # pyfunc's records pass as it answers them
        await self._send(send, 200, json.dumps({"predictions": answer}).encode(), "application/json", rid)
        return Outcome(200, None, len(parsed.texts))

    async def _overloaded(self, send: Send, rid: str) -> Outcome:
        log.warning("request %s: %d scoring requests in flight, the limit: answered 503", rid, self._in_flight)
        return await self._retry_later(send, rid, f"the server is answering {self._in_flight} requests, its limit",
                                       "overloaded")

    async def _retry_later(self, send: Send, rid: str, why: str, kind: str) -> Outcome:
        """A 503 with `Retry-After`: `why`, and when to try again."""
        await self._json(send, 503, {"error": f"{why}; retry after {RETRY_AFTER_S} s", "status": 503,
                                     "request_id": rid}, rid, [(b"retry-after", str(RETRY_AFTER_S).encode())])
        return Outcome(503, kind)

    async def _scored(self, texts: list[str], rid: str) -> tuple[int, list[Any] | None]:
        """A checked request's texts scored with those of concurrent requests: (status, its predictions)."""
        pending = _Pending(texts, rid, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await pending.answer

    async def _failed(self, send: Send, status: int, rid: str) -> Outcome:
        """The contract's answer to a request that passed it and then failed (`status`: 504 when scoring timed out,
        else 500): the server's failure, never the caller's (MLflow's own app answers a model that raised with 400)."""
        if status == 504:
            await self._json(send, 504, {"error": "scoring this request took longer than the server's timeout",
                                         "status": 504, "request_id": rid}, rid)
            return Outcome(504, "timeout")
        if status == 503:
            return await self._retry_later(send, rid, "the model is still busy with a call that timed out", MODEL_BUSY)
        await self._json(send, 500, {"error": "internal error while scoring this request (logged on the server "
                                              "with its request id)", "status": 500, "request_id": rid}, rid)
        return Outcome(500, MODEL_ERROR)

    async def _drain(self) -> None:
        """Score the queued requests, a batch at a time: each batch is the requests queued while the previous one
        ran (up to `MAX_BATCH_TEXTS` texts), scored in one call of the model, and each request gets its own slice of
        the predictions. A batch that fails is scored again request by request, so only the request at fault fails.
        Every request taken ends with an answer."""
        while self._queue:
            batch = take_oldest(self._queue, lambda p: len(p.texts), MAX_BATCH_TEXTS)
            try:
                await self._score_batch(batch)
            except Exception:
                log.exception("requests %s: scoring failed", ", ".join(p.rid for p in batch))
            for pending in batch:  # anything not answered above is the server's failure
                if not pending.answer.done():
                    pending.answer.set_result((500, None))

    async def _score_batch(self, batch: list[_Pending]) -> None:
        status, predictions, detail = await self._model([t for p in batch for t in p.texts])
        if status == 200:
            start = 0
            for pending in batch:
                _resolve(pending, 200, predictions[start : start + len(pending.texts)])
                start += len(pending.texts)
            return
        if len(batch) > 1 and status == 500:  # find the request at fault: each on its own (not a timeout, 504/503)
            log.warning("requests %s: a batch of %d requests failed (%d: %s), scoring each alone",
                        ", ".join(p.rid for p in batch), len(batch), status, detail)
            for pending in batch:
                await self._score_batch([pending])
            return
        for pending in batch:
            _log_failure(pending.rid, status, detail)
            _resolve(pending, status, None)

    async def _model(self, texts: list[str]) -> tuple[int, list[Any], str]:
        """The pyfunc on `texts`, in the model's thread so the event loop goes on reading requests: (status,
        predictions, error detail). 504 past `timeout_s`; the thread cannot be stopped, so until that call ends every
        call is a 503 at once (requests queued behind a hung model fail fast instead of waiting a timeout each,
        and the readiness probe says not ready). 500 when the model raised or answered the wrong number of rows."""
        if self._timed_out is not None:
            if not self._timed_out.done():
                return 503, [], "the model is still running a call that timed out"
            self._timed_out = None
        call = self._model_thread.submit(self.score, texts)
        try:
            predictions = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call)), self.timeout_s)
        except TimeoutError:
            self._timed_out = call
            return 504, [], f"scoring {len(texts)} texts took longer than {self.timeout_s:g} s"
        except Exception as exc:
            return 500, [], f"{type(exc).__name__}: {exc}"[:300]
        if not isinstance(predictions, list) or len(predictions) != len(texts):
            return 500, [], f"the model answered {type(predictions).__name__} for {len(texts)} texts"
        return 200, predictions, ""

    async def _call_app(self, scope: Scope, body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """MLflow's app on one request: its status, body (an error body kept to 2 KB: it quotes the input) and
        headers."""
        start: Message = {}
        parts: list[bytes] = []
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # the body was consumed: as a client that keeps the connection open
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                if start.get("status") == 200 or sum(map(len, parts)) < 2048:
                    parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        return int(start.get("status", 500)), b"".join(parts), list(start.get("headers", []))

    async def _body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The request body, refused (413) as soon as it is known to exceed `max_body_bytes` (what is left of it is
        read and dropped first, `_discard_body`), and 408 when it is not all in within `body_timeout_s`."""
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            if not expects_continue(headers):  # a client waiting for "100 Continue" has sent nothing to drop
                await _discard_body(headers, receive)  # (and reading would invite it to upload)
            raise RequestError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit}")
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                        f"({size} bytes received)") from None
            if message["type"] == "http.disconnect":
                raise RequestError(400, "the client closed the connection before the body was complete")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if message.get("more_body", False):
                    await _discard_body(headers, receive)
                raise RequestError(413, f"request body of more than {limit} bytes exceeds the limit of {limit}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _forward(self, scope: Scope, body: bytes, send: Send, rid: str) -> Outcome:
        """Run MLflow's app on `body` (its GET paths); a 200 goes out with the model headers, anything else becomes
        the contract's JSON error (`_failed`: MLflow's own error bodies may quote the input and be any size)."""
        status, answer, headers = await self._call_app(scope, body)
        if status != 200:  # MLflow's own GET route failed: said as such, with MLflow's status in the log only
            _log_failure(rid, status, answer[:300].decode("utf-8", "replace"))
            await self._json(send, 500, {"error": f"{scope.get('path')} failed inside MLflow's scoring app (logged on "
                                                  "the server with its request id)", "status": 500,
                                         "request_id": rid}, rid)
            return Outcome(500, "server_error")
        headers = [h for h in headers if h[0].lower() != b"server"]
        await send({"type": "http.response.start", "status": 200, "headers": [*headers, *self.model_headers(rid)]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})
        return Outcome(200)

    async def _ready(self, send: Send, rid: str) -> int:
        """200 with the model when one review goes through the pyfunc, else 503. Probes that arrive while a probe's
        review is being scored share that call: a flood of `/ready` costs one scoring at a time, not one each."""
        if self._readiness is None or self._readiness.done():
            self._readiness = asyncio.create_task(self._model([READY_TEXT]))
        status, _, detail = await asyncio.shield(self._readiness)  # a probe that goes away leaves it to the others
        if status != 200:
            _log_failure(rid, status, detail)
        ok = status == 200
        await self._json(send, 200 if ok else 503, {"status": "ready" if ok else "not ready",
                                                    "version": self.version, "variant": self.variant}, rid)
        return 200 if ok else 503

    async def _error(self, send: Send, err: RequestError, rid: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> Outcome:
        await self._json(send, err.status, {**error_body(err), "request_id": rid}, rid, extra)
        return Outcome(err.status)

    async def _json(self, send: Send, status: int, body: dict[str, Any], rid: str,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(send, status, json.dumps(body).encode(), "application/json", rid, extra)

    async def _send(self, send: Send, status: int, body: bytes, content_type: str, rid: str,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                   *self.model_headers(rid), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def headers_only(send: Send) -> Send:
    """`send` for a HEAD request: the answer's start as it is, its body empty (uvicorn sends none for HEAD)."""
    async def headers_only_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            await send(message)
        elif not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return headers_only_send


def expects_continue(headers: dict[str, str]) -> bool:
    """The client sent `Expect: 100-continue`: it uploads its body only when the server asks for it (uvicorn does so
    on the first read of the body), so a body refused unread is never sent."""
    return headers.get("expect", "").strip().lower() == "100-continue"


async def _discard_body(headers: dict[str, str], receive: Receive) -> None:
    """Read and drop the rest of a refused body before the 413 goes out, when it is at most `DISCARD_BODY_BYTES`:
    uvicorn closes a connection whose body was left unread, and a client still writing then gets a connection
    reset instead of the 413 (after the answer, the body can no longer be read). A longer body, or one still not
    in after `DISCARD_WAIT_S` in all (a client that stops, or trickles), is not waited for."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DISCARD_BODY_BYTES:
        return
    left = DISCARD_BODY_BYTES
    deadline = asyncio.get_running_loop().time() + DISCARD_WAIT_S
    while left > 0:
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        left -= len(message.get("body", b""))


def log_config(log_dir: Path, max_bytes: int, backups: int) -> dict[str, Any]:
    """uvicorn's and this module's loggers into one size-rotated file, appended across restarts, and warnings
    to the console."""
    handler = {"class": "logging.handlers.RotatingFileHandler", "filename": str(log_dir / "mlflow_server.log"),
               "maxBytes": max_bytes, "backupCount": backups, "encoding": "utf-8", "mode": "a",
               "formatter": "plain"}
    console = {"class": "logging.StreamHandler", "level": "WARNING", "formatter": "plain"}
    loggers = {name: {"handlers": ["file", "console"], "level": "INFO", "propagate": False}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "serving", "mlflow")}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
            "handlers": {"file": handler, "console": console}, "loggers": loggers,
            "root": {"handlers": ["file", "console"], "level": "WARNING"}}


def served_version(model_uri: str | None, *, name: str, alias: str, tracking_uri: str) -> tuple[str, dict[str, str]]:
    """The registry version a model URI names in store `tracking_uri` and that version's tags: the champion
    (`models:/<name>@<alias>`) when no URI is given, the alias or version of a `models:/<name>@<alias>` or
    `models:/<name>/<version>` URI, and "unregistered" for any other model (a LoggedModel id, a path)."""
    from pipeline.core.model_registry import registered_version, version_tags

    if model_uri is None:
        return registered_version(name, alias, tracking_uri=tracking_uri)
    if m := re.fullmatch(r"models:/([^/@]+)@([^/]+)", model_uri):
        return registered_version(m[1], m[2], tracking_uri=tracking_uri)
    if m := re.fullmatch(r"models:/([^/@]+)/(\d+)", model_uri):
        return m[2], version_tags(m[1], m[2], tracking_uri=tracking_uri)
    return "unregistered", {}


def build_app(model_uri: str | None, params_path: Path, max_in_flight: int = MAX_IN_FLIGHT,
              body_timeout_s: float = BODY_TIMEOUT_S) -> ContractMiddleware:
    """Load the champion (or `model_uri`) and serve it through the contract. The store (`$MLFLOW_TRACKING_URI`,
    else the params') is read once and handed to every registry lookup and to the model's download: MLflow's
    process-wide tracking URI and the environment are left as they are."""
    from pipeline.core.params import load_params_or_defaults
    from pipeline.core.parent_run import tracking_uri
    from pipeline.deployment.mlflow_model import served_model

    params = load_params_or_defaults(params_path)
    store = tracking_uri(params.mlflow)
    name, alias = params.mlflow.registered_model_name, params.mlflow.champion_alias
    version, tags = served_version(model_uri, name=name, alias=alias, tracking_uri=store)
    requested = uri = model_uri or f"models:/{name}@{alias}"
    if (m := re.fullmatch(r"models:/([^/@]+)@([^/]+)", uri)) and version.isdigit():
        # load the version just resolved, not the alias again: an alias moved in between (a `make run` finishing)
        # would serve one version under the other's number
        uri = f"models:/{m[1]}/{version}"
    model = served_model(uri, tracking_uri=store)
    variant = model.variant or tags.get("variant", "unknown")
    log.info("serving %s (%s, version %s, variant %s) from %s", requested, uri, version, variant, store)
    limits = Limits.from_config(vars(params.package))
    return ContractMiddleware(model.app, model.score, limits, version, variant, Metrics(version, variant),
                              timeout_s=model.timeout_s, max_in_flight=max_in_flight, body_timeout_s=body_timeout_s)


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="limits (package.*) and the registry entry (mlflow.*); defaults if params.yaml is absent")
    parser.add_argument("--model-uri", help="serve this model instead of models:/<name>@<alias> (same limits)")
    parser.add_argument("--log-dir", type=Path, default=Path("logs"))
    parser.add_argument("--log-max-bytes", type=int, default=10_000_000)
    parser.add_argument("--log-backups", type=int, default=5)
    parser.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT,
                        help="scoring requests answered at once; one more is answered 503 with Retry-After")
    parser.add_argument("--limit-concurrency", type=int, default=256,
                        help="connections open at once (above --max-in-flight); one more is answered 503 with "
                             "Retry-After and closed")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help="seconds a connection may take to send a request's line and headers (408 and closed)")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help="seconds a request may take to send its body (408 and closed)")
    parser.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT_S,
                        help="seconds an answer may wait for a client that reads none of it (then dropped)")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config = log_config(args.log_dir, args.log_max_bytes, args.log_backups)
    logging.config.dictConfig(config)
    from pipeline.core.model_registry import StoreError, store_errors
    from pipeline.core.params import ParamsError

    try:
        with store_errors():
            app = build_app(args.model_uri, args.params, args.max_in_flight, args.body_timeout)
    except LookupError as exc:  # no champion yet: say what to do instead of a traceback
        raise SystemExit(f"{exc}: run `make run` first (its package stage registers and aliases the model)") from None
    except FileNotFoundError as exc:  # a --params that is not there
        raise SystemExit(str(exc)) from None
    except ParamsError as exc:  # a --params that is not valid
        raise SystemExit(f"{args.params}: {exc}") from None
    except StoreError as exc:  # the store unreachable or refusing, a version or model it does not have
        raise SystemExit(f"the model to serve could not be read from the tracking store: {exc}") from None
    print(f"serving {app.variant} (version {app.version}) at http://{args.host}:{args.port}/invocations; "
          f"logs in {args.log_dir / 'mlflow_server.log'}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port,
                http=request_deadline_protocol(args.header_timeout, args.send_timeout, args.limit_concurrency,
                                               [(VERSION_HEADER, app.version), (VARIANT_HEADER, app.variant)],
                                               on_refusal=app.metrics.refused),
                h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES, timeout_keep_alive=5, server_header=False,
                log_config=config)


if __name__ == "__main__":
    from pipeline.core.process_exit import skip_final_collection

    skip_final_collection()
    main()
