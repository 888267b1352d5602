"""Serving: the MLflow server's middleware behind its connection protocol (`serving.request_deadline`), on a real
uvicorn server with a stand-in model: a request the protocol refuses mid-body is answered and counted once, and
an upload over the body limit sent in ordinary TCP segments gets its 413, not the piece budget's 400."""

from __future__ import annotations

import gc
import logging
import socket
import time

import pytest

from serving.contract_middleware import ContractMiddleware
from serving.endpoint_metrics import Metrics
from serving.request_deadline import request_deadline_protocol
from tests import factories
from tests.factories import chunked_body, log_records, read_until_closed, uvicorn_in_thread

#: Where an error answering a request is logged: the server's own code, uvicorn's, and asyncio's for an exception
#: left in a request's task.
ERROR_LOGGERS = ("serving", "uvicorn.error", "asyncio")


def _middleware(metrics: Metrics) -> ContractMiddleware:
    return ContractMiddleware(None, lambda texts: [{"label": "positive", "score": 0.9}] * len(texts),
                              factories.limits(max_texts=4), "3", "test-variant", metrics, timeout_s=10.0)


def _count(metrics: Metrics, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples
               if s.name == name and s.labels.get("status", "4").startswith("4") and s.value)


@pytest.mark.parametrize("tail", [
    chunked_body([b"x"] * 200),                 # past the piece budget (50 here)
    b"1\r\nx\r\n" * 3 + b"zz\r\n",         # a bad chunk size mid-body: h11 cannot read it
])
def test_a_body_refused_by_the_protocol_mid_upload_is_counted_once(tail):
    """A body the protocol refuses mid-upload (past the piece budget, or unreadable) is one request and one 400 in
    `/metrics`: the protocol counts its answer (`Metrics.refused`), and the app, which then hears only
    `http.disconnect` while it waits for the body, does not count it again (before, it recorded a second 400, "the
    client closed the connection", for a request the client never abandoned). Nothing is logged as an error, now
    or when the request's task is collected (before, uvicorn's own 500 for an app that answered nothing met h11's
    closed state: "ASGI callable returned without starting response" and an exception left in the task, logged
    with its traceback by asyncio whenever the collector got to it)."""
    metrics = Metrics("3", "test-variant")
    protocol = request_deadline_protocol(30.0, 30.0, max_body_pieces=50, on_refusal=metrics.refused)
    head = (b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    with log_records(*ERROR_LOGGERS, level=logging.ERROR) as records:
        with uvicorn_in_thread(_middleware(metrics), protocol) as port:
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(head + tail)
                    data, _ = read_until_closed(sock)
                assert data.startswith(b"HTTP/1.1 400 ")
            time.sleep(0.5)  # the app's tasks end once they hear of the disconnect
            requests = _count(metrics, "sentiment_requests_total")
            errors = _count(metrics, "sentiment_request_errors_total")
        gc.collect()  # a task that ended with an exception nobody retrieved logs it when collected
    assert (requests, errors) == (3, 3), (requests, errors)
    assert [r.getMessage() for r in records] == []


def test_an_oversized_content_length_upload_in_full_segments_gets_its_413_not_the_piece_budgets_400():
    """A client that declares a 2 MB Content-Length (over the 1 MB limit, under DISCARD_BODY_BYTES, no Expect) and
    sends it in full-size TCP segments, as any upload over a real network arrives, gets the middleware's 413 after
    the rest is read and dropped, not the piece budget's 400: its pieces (one per socket read) pass the budget's
    count, but they are large, and only many small pieces cost the event loop (before, a hard cap on the count
    answered it a 400 and reset the connection mid-upload). The budget is 200 here, so ~300 reads pass it."""
    metrics = Metrics("3", "test-variant")
    protocol = request_deadline_protocol(30.0, 30.0, max_body_pieces=200, on_refusal=metrics.refused)
    size = 2_000_000
    with uvicorn_in_thread(_middleware(metrics), protocol) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % size)
            sent = 0
            try:
                while sent < size:
                    sent += sock.send(b"x" * min(1448, size - sent))
                    time.sleep(0.0005)  # one segment a read, as a 20-30 Mbit/s link delivers them
            except OSError:
                pass
            data = b""
            try:
                while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
                    data += chunk
            except OSError:
                pass
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]


@pytest.mark.parametrize("head", [
    b"POST /nope HTTP/1.1\r\nHost: t\r\n",                                                      # 404
    b"PUT /invocations HTTP/1.1\r\nHost: t\r\n",                                                # 405
    b"GET /metrics HTTP/1.1\r\nHost: t\r\n",                                                    # answered at once
    b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Type: application/json\r\n",                                                      # 400 from headers
])
def test_a_request_the_app_answers_without_its_body_and_unreadable_framing_in_one_read_logs_no_error(head):
    """Headers the app answers without reading the body, and unreadable chunk framing after them, in one packet:
    the protocol answers its JSON 400 before the app's task first runs, and the app's own answer then meets a
    closed connection. The client gets the one 400; the server logs no error and no 500 (before, each such
    request wrote two ERROR tracebacks, about 6 KB of log: a cheap way to rotate the server's log away) and
    counts the request once."""
    metrics = Metrics("3", "test-variant")
    protocol = request_deadline_protocol(30.0, 30.0, on_refusal=metrics.refused)
    with log_records(*ERROR_LOGGERS, level=logging.ERROR) as records:
        with uvicorn_in_thread(_middleware(metrics), protocol) as port:
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
                    data, _ = read_until_closed(sock)
                assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1 ") == 1, data
            time.sleep(0.5)  # the app's tasks end
            requests = _count(metrics, "sentiment_requests_total")
        gc.collect()
    assert [r.getMessage() for r in records] == []
    assert requests == 3


def test_a_505_for_an_http_2_request_line_keeps_the_connection_so_a_valid_request_follows_on_it():
    """A text request line naming HTTP/2.0 gets its JSON 505 on a real uvicorn server, its body read and dropped
    rather than cut off by a reset, and the same connection then answers an HTTP/1.1 request."""
    metrics = Metrics("3", "test-variant")
    protocol = request_deadline_protocol(30.0, 30.0, on_refusal=metrics.refused)
    body = b'{"inputs": ["a fine film"]}'
    head = b"POST /invocations %s\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with uvicorn_in_thread(_middleware(metrics), protocol) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head % (b"HTTP/2.0", len(body)) + body)
            first = b""
            while not first.endswith(b"}"):  # the JSON 505, whole
                first += sock.recv(65536)
            last = (head % (b"HTTP/1.1", len(body))).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
            sock.sendall(last + body)
            rest, _ = read_until_closed(sock)
    assert first.startswith(b"HTTP/1.1 505 ") and b'"status": 505' in first, first
    assert rest.startswith(b"HTTP/1.1 200 ") and b'"positive"' in rest, rest
