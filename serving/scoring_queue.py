"""The MLflow server's scoring queue: server-side batching in front of one model thread.

uvicorn's event loop reads and checks requests; the checked texts of the requests that arrive while the model is
scoring go to it together in its next call, in the model's own thread (as TorchServe's frontend batches, with no
delay: a lone request goes at once), and each request gets its slice of the predictions. Whatever per-call work
remains is paid once per batch, and one forward pass at a time uses the runtime's threads (all cores, or
`package.threads`). Readiness probes (`GET /ready`) queue one review like any request, so a probe never runs beside
a batch on the model (where one of the two would wait out the other's time against its own timeout); probes that
arrive while one is queued or scoring share it. Below this, the predictor also merges calls from several threads
(`pipeline.deployment.coalescing`) and every runtime lends each call what it cannot share
(`pipeline.runtimes.pool`), so the model is safe however it is called.

Every field of `ScoringQueue` is touched on the event loop only; the model thread only completes a
`concurrent.futures.Future`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.deployment.coalescing import MAX_BATCH_TEXTS, take_oldest

log = logging.getLogger(__name__)

READY_TEXT = "readiness probe: a fine film"
#: The name the readiness probe's call goes by in the log (probes share one call, so no one request's id).
READINESS = "readiness-probe"

#: What a scoring call came to: (status, predictions, error detail); 200, 500 (the model failed), 503 (the model is
#: still busy with a call that timed out) or 504 (this call timed out).
Scored = tuple[int, list[Any], str]


class ModelThread:
    """One daemon thread that runs the model's calls in the order they are submitted, each answered through its
    `Future`. Not a `ThreadPoolExecutor`: Python joins that pool's threads at exit, so a scoring call that hangs
    (the case a 504 answers) would keep a stopped server's process alive until it is killed; a daemon thread ends
    with the process. It never ends before: whatever a call raises goes to its `Future`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._start = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """`fn(*args)` on the model's thread (started on the first call)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, lambda: fn(*args)))
        with self._start:  # whichever thread submits first starts it, once
            if self._thread.ident is None:
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


@dataclass(eq=False)
class _Pending:
    """Texts waiting for their batch: a checked request's (or the readiness probe's), the id the log names it by and
    where its answer goes."""

    texts: list[str]
    rid: str
    answer: asyncio.Future[Scored]


def log_failure(rid: str, status: int, detail: str) -> None:
    """The server log's line for a request the model did not answer (`status`: 504 timed out, 503 the model still
    busy with a call that timed out, else 500: the model failed), with its id and the error's first line."""
    if status == 504:
        log.error("request %s: scoring timed out: %s", rid, detail)
    elif status == 503:
        log.warning("request %s: answered 503: %s", rid, detail)
    else:
        log.error("request %s: the model failed on a request the contract accepted: %s", rid, detail)


def _resolve(pending: _Pending, scored: Scored) -> None:
    if not pending.answer.done():  # a client that went away cancelled its wait
        pending.answer.set_result(scored)


@dataclass
class ScoringQueue:
    """Requests' texts scored in batches by `score` (blocking: texts in, one record each out) on the model's thread,
    one call at a time; a call past `timeout_s` is answered 504 (see the module doc)."""

    score: Callable[[list[str]], list[Any]]
    timeout_s: float
    _queue: list[_Pending] = field(default_factory=list, init=False)
    _drainer: asyncio.Task[None] | None = field(default=None, init=False)
    _readiness: _Pending | None = field(default=None, init=False)  # the probe queued or scoring, shared
    _model_thread: ModelThread = field(default_factory=ModelThread, init=False)
    #: A call that timed out and is still running: until it ends, new calls are answered 503 at once instead of
    #: queueing behind it (the thread cannot be stopped).
    _timed_out: concurrent.futures.Future[Any] | None = field(default=None, init=False)

    async def scored(self, texts: list[str], rid: str) -> Scored:
        """A checked request's texts scored with those of concurrent requests: (status, its predictions, detail)."""
        pending = _Pending(texts, rid, asyncio.get_running_loop().create_future())
        self._enqueue(pending)
        return await pending.answer

    async def ready(self) -> Scored:
        """One review through the model, in the queue like any request; probes that arrive while one is queued or
        scoring share its call (a flood of `/ready` costs one scoring at a time, not one each)."""
        if self._readiness is None or self._readiness.answer.done():
            self._readiness = _Pending([READY_TEXT], READINESS, asyncio.get_running_loop().create_future())
            self._enqueue(self._readiness)
        return await asyncio.shield(self._readiness.answer)  # a probe that goes away leaves it to the others

    def _enqueue(self, pending: _Pending) -> None:
        self._queue.append(pending)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())

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
                _resolve(pending, (500, [], "scoring failed (logged)"))

    async def _score_batch(self, batch: list[_Pending]) -> None:
        status, predictions, detail = await self._model([t for p in batch for t in p.texts])
        if status == 200:
            start = 0
            for pending in batch:
                _resolve(pending, (200, predictions[start : start + len(pending.texts)], ""))
                start += len(pending.texts)
            return
        if len(batch) > 1 and status == 500:  # find the request at fault: each on its own (not a timeout, 504/503)
            log.warning("requests %s: a batch of %d requests failed (%d: %s), scoring each alone",
                        ", ".join(p.rid for p in batch), len(batch), status, detail)
            for pending in batch:
                await self._score_batch([pending])
            return
        for pending in batch:
            log_failure(pending.rid, status, detail)
            _resolve(pending, (status, [], detail))

    async def _model(self, texts: list[str]) -> Scored:
        """The model on `texts`, in its thread so the event loop goes on reading requests. 504 past `timeout_s`
        (counted from the call's start: the queue sends one call at a time); the thread cannot be stopped, so until
        that call ends every call is a 503 at once (requests queued behind a hung model fail fast instead of waiting
        a timeout each, and the readiness probe says not ready). 500 when the model raised or answered the wrong
        number of rows."""
        if self._timed_out is not None:
            if not self._timed_out.done():
                return 503, [], "the model is still busy with a call that timed out"
            self._timed_out = None
        call = self._model_thread.submit(self.score, texts)
        try:
            predictions = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call)), self.timeout_s)
        except TimeoutError:
            self._timed_out = call
            return 504, [], f"scoring {len(texts)} texts took longer than {self.timeout_s:g} s"
        except Exception as exc:  # the traceback goes to the log once per call; the answer carries its first line
            log.error("the model raised scoring %d texts", len(texts), exc_info=exc)
            return 500, [], f"{type(exc).__name__}: {exc}"[:300]
        if not isinstance(predictions, list) or len(predictions) != len(texts):
            return 500, [], f"the model answered {type(predictions).__name__} for {len(texts)} texts"
        return 200, predictions, ""

