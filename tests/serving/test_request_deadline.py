"""Serving: `serving.request_deadline`, uvicorn's h11 protocol with a deadline on each request's line and headers,
on a real uvicorn server (in a thread, on a free loopback port, a trivial ASGI app): slow-HTTP clients that send
nothing, or headers a byte at a time, lose their connection at the deadline (a 408 to the one that began a
request); a request sent in time is answered, and so is the next one on the same connection, whose deadline
starts again after the answer; a connection past the server's limit gets the contract's 503 at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from serving.request_deadline import request_deadline_protocol
from tests.factories import chunked_body, read_until_closed, uvicorn_in_thread

DEADLINE_S = 0.6
#: `/big`'s answer: far more than a socket's send and receive buffers hold together.
BIG = 64 * 1024 * 1024
#: Set when the app's last send of `/big` returned (the answer went out, or the connection was dropped).
big_sent = threading.Event()


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers "ok" at once without reading any body; on `/slow` after `DEADLINE_S`, on `/slower` after twice
    that; `/big` answers `BIG` bytes; `/read` reads the body and answers its length."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(BIG).encode())]})
        chunk = b"x" * (1 << 20)
        for left in range(BIG, 0, -len(chunk)):  # in parts: each waits for the buffer to drain, as an app's do
            await send({"type": "http.response.body", "body": chunk, "more_body": left > len(chunk)})
        big_sent.set()
        return
    if scope["path"] == "/read":  # reads the whole body first, then answers its length
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        answer = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})
        return
    if scope["path"] in ("/slow", "/slower"):
        await asyncio.sleep(DEADLINE_S * (2 if scope["path"] == "/slower" else 1))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serving(protocol: type[asyncio.Protocol]) -> contextlib.AbstractContextManager[int]:
    """`hello` under uvicorn with `protocol`, in a thread, on a free loopback port; stopped afterwards."""
    return uvicorn_in_thread(hello, protocol, timeout_keep_alive=30)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving(request_deadline_protocol(DEADLINE_S, DEADLINE_S)) as port:
        yield port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline_without_an_answer(port):
    with connect(port) as sock:
        data, waited = read_until_closed(sock)
    assert data == b"" and DEADLINE_S * 0.8 <= waited < DEADLINE_S + 5


def test_headers_sent_a_byte_at_a_time_get_a_408_and_the_connection_closed(port):
    with connect(port) as sock:
        start = time.monotonic()
        sent = 0
        with pytest.raises(OSError):  # the server closed the connection while the client was still sending
            for byte in REQUEST[:-2]:
                sock.sendall(bytes([byte]))
                sent += 1
                time.sleep(DEADLINE_S / 8)
            raise AssertionError("the whole request line and headers went out: no deadline")
        assert sent < len(REQUEST) - 2 and time.monotonic() - start < DEADLINE_S + 5
    with connect(port) as sock:
        sock.sendall(REQUEST[:10])
        data, _ = read_until_closed(sock)
    answer = contract_error(data, 408)
    assert answer["error"] == "the request line and headers did not arrive in time"


def contract_error(data: bytes, status: int, headers: tuple[bytes, ...] = ()) -> dict[str, Any]:
    """The contract's JSON error in the raw answer `data`: `status` in the status line and the body, a request id in
    the body and `X-Request-Id`, the connection closed, and each of `headers` (lower-case) in the head."""
    import json

    head, _, body = data.partition(b"\r\n\r\n")
    answer = json.loads(body)
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(f"http/1.1 {status} ".encode()) and answer["status"] == status, data
    assert f"x-request-id: {answer['request_id']}".encode() in lines and b"connection: close" in lines, data
    assert all(h in lines for h in headers) and b"content-type: application/json" in lines, data
    return answer


def test_requests_in_time_are_answered_and_a_kept_connection_gets_a_new_deadline(port):
    with connect(port) as sock:
        for _ in range(3):  # each request well after the previous connection's opening, each inside its deadline
            time.sleep(DEADLINE_S / 2)
            sock.sendall(REQUEST)
            answer = b""
            while not answer.endswith(b"\r\n\r\nok"):  # the head and the body may come in two reads
                answer += sock.recv(4096) or b"(closed)"
                assert not answer.endswith(b"(closed)"), answer
            assert answer.startswith(b"HTTP/1.1 200 ")
        data, waited = read_until_closed(sock)  # then idle: closed at the deadline, silently
    assert data == b"" and waited < DEADLINE_S + 5


def read_answer(sock: socket.socket, body: bytes = b"ok") -> bytes:
    answer = b""
    while not answer.endswith(b"\r\n\r\n" + body):  # the head and the body may come in two reads
        answer += sock.recv(4096) or b"(closed)"
        assert not answer.endswith(b"(closed)"), answer
    return answer


POST_HEAD = b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n"


def test_the_unread_rest_of_an_answered_body_is_dropped_until_the_deadline(port):
    """The app answers without reading the body (as a 413 from the declared length does): a client that goes on
    sending it a byte at a time loses the connection at the deadline instead of holding it."""
    with connect(port) as sock:
        sock.sendall(POST_HEAD + b"x" * 10)
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.settimeout(DEADLINE_S / 8)
        start, sent = time.monotonic(), 0
        with pytest.raises(OSError):
            while time.monotonic() - start < DEADLINE_S + 5:
                sock.sendall(b"x")
                sent += 1
                try:
                    if sock.recv(4096) == b"":  # closed by the server: the next send fails
                        sock.sendall(b"x")
                except TimeoutError:  # nothing from the server yet: keep trickling
                    continue
            raise AssertionError("the connection was still open")
        assert time.monotonic() - start < DEADLINE_S + 5 and sent >= 4


def test_a_body_finished_after_its_answer_leaves_the_connection_usable(port):
    """The same early answer, then the client sends the rest of the body at once and its next request on the same
    connection: that request is answered, although its answer takes longer than the deadline (the lingering
    deadline ends with the body it was for)."""
    with connect(port) as sock:
        sock.sendall(POST_HEAD + b"x" * 10)
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"x" * 990)
        time.sleep(DEADLINE_S / 4)
        sock.sendall(REQUEST.replace(b"GET / ", b"GET /slow "))  # its answer comes after that deadline
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_pipelined_request_is_answered_however_long_its_answer_takes(port):
    """Two requests sent together, the second's body still arriving when the first is answered: the deadline that
    drops the rest of an answered request's body is not put on the next request, whose answer comes after it."""
    with connect(port) as sock:
        sock.sendall(REQUEST + b"POST /slower HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\n12345")
        time.sleep(DEADLINE_S / 4)
        sock.sendall(b"67890")
        first = read_answer(sock)
        second = first.split(b"\r\n\r\nok", 1)[1] or read_answer(sock)
    assert first.startswith(b"HTTP/1.1 200 ") and second.startswith(b"HTTP/1.1 200 ")


def test_a_client_that_reads_none_of_its_answer_is_dropped_at_the_send_deadline(port):
    """A client that asks for a large answer and reads nothing: once the server's send buffer is full, the
    connection is dropped at the deadline and the app's pending send returns (before, it waited for as long as the
    client kept the connection open, holding what the request held)."""
    big_sent.clear()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffer fills soon
    sock.connect(("127.0.0.1", port))
    with sock:
        sock.sendall(REQUEST.replace(b"GET / ", b"GET /big "))
        assert big_sent.wait(DEADLINE_S + 10), "the app's send never returned"
        sock.settimeout(10)
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
    assert received < BIG  # what the buffers held, then the connection ended


def test_bad_bytes_after_an_early_answer_close_the_connection_without_an_error(port, caplog):
    """A chunked body answered before it was read, then bytes that are no chunk: uvicorn's 400 cannot be framed
    after an answer (h11 raised out of `data_received`, which asyncio logs as a fatal protocol error); the
    connection is closed quietly instead."""
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"zz\r\n")
        data, waited = read_until_closed(sock)
    assert data == b"" and waited < DEADLINE_S + 5
    assert not [r for r in caplog.records if "data_received" in r.getMessage() or r.levelno >= logging.ERROR]


def test_a_connection_past_the_limit_gets_the_contracts_503_at_once_and_a_freed_slot_serves_again():
    """Idle connections fill the limit (as slow clients would until their deadline): the next connection gets a
    JSON 503 with `Retry-After` and the served model's headers before it sends anything, and is closed; once one
    of the idle ones goes, a request is answered again."""
    protocol = request_deadline_protocol(30.0, 30.0, max_connections=3, refusal_headers=[("X-Model-Version", "7")])
    with serving(protocol) as port:
        idle = [connect(port) for _ in range(3)]
        time.sleep(0.2)  # the server has taken all three
        with connect(port) as sock:
            data, _ = read_until_closed(sock)
        answer = contract_error(data, 503, (b"retry-after: 1", b"x-model-version: 7"))
        assert answer["error"] == "the server holds its limit of 3 connections; retry after 1 s"
        with connect(port) as sock:  # a client that sends its request at once still reads the 503, not a reset
            sock.sendall(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
            time.sleep(0.2)  # the server has answered and closed its side before the client reads
            data, _ = read_until_closed(sock)
        contract_error(data, 503, (b"retry-after: 1",))
        idle.pop().close()
        time.sleep(0.2)
        with connect(port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            data, _ = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"ok")
        for sock in idle:
            sock.close()


def test_a_body_past_its_piece_budget_gets_the_contracts_400_and_the_connection_closed():
    """A body in more chunks than `max_body_pieces` (each costs the event loop the same whatever its size): the
    contract's JSON 400 with a request id and the model's headers, the connection closed, the refusal reported;
    bodies within the budget are read whole, and the count starts again with each request of a connection."""

    told: list[tuple[int, str]] = []
    protocol = request_deadline_protocol(30.0, 30.0, refusal_headers=[("X-Model-Version", "7")], max_body_pieces=50,
                                         on_refusal=lambda status, kind: told.append((status, kind)))
    head = b"POST /read HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
    with serving(protocol) as port:
        with connect(port) as sock:  # two requests of 40 one-byte chunks each on one connection
            for _ in range(2):
                sock.sendall(head + chunked_body([b"x"] * 40))
                assert read_answer(sock, b"40").startswith(b"HTTP/1.1 200 ")
        with connect(port) as sock:
            sock.sendall(head + chunked_body([b"x"] * 200))
            data, _ = read_until_closed(sock)
        with connect(port) as sock:  # the refusal names the request by the id its client sent
            sock.sendall(head.replace(b"Host: test", b"Host: test\r\nX-Request-Id: client-abc")
                         + chunked_body([b"x"] * 200))
            named, _ = read_until_closed(sock)
    answer = contract_error(data, 400, (b"x-model-version: 7",))
    assert "more than 50 pieces" in answer["error"] and len(answer["request_id"]) == 32
    assert contract_error(named, 400)["request_id"] == "client-abc"
    assert told == [(400, "too_many_pieces")] * 2


@pytest.mark.parametrize("request_bytes", [
    b"POST /read HTTP/1.1\r\nHost: test\r\nContent-Length: 1x\r\n\r\n",       # a length that is no number
    b"POST /read HTTP/1.1\r\nContent-Length: 1\r\n\r\nx",                      # no Host
    b"POST /read HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk size
    b"GET / HTTP/1.1\r\nHost: test\r\nBad header\r\n\r\n",                    # a header with no colon
])
def test_bytes_that_are_no_request_get_the_contracts_json_400_not_plain_text(request_bytes):
    """What uvicorn answers in plain text ("Invalid HTTP request received.") is the contract's JSON error with a
    request id and the model's headers, naming none of the bytes sent; the refusal is reported."""
    import json

    told: list[tuple[int, str]] = []
    protocol = request_deadline_protocol(30.0, 30.0, refusal_headers=[("X-Model-Version", "7")],
                                         on_refusal=lambda status, kind: told.append((status, kind)))
    with serving(protocol) as port, connect(port) as sock:
        sock.sendall(request_bytes)
        data, _ = read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head and b"x-model-version: 7" in head.lower()
    answer = json.loads(body)
    assert answer["error"].startswith("malformed HTTP request") and answer["status"] == 400
    assert f"x-request-id: {answer['request_id']}".encode() in head.lower()
    assert told == [(400, "malformed_http")]


@pytest.mark.parametrize(("configured", "limit"), [(None, 16 * 1024), (4096, 4096)])
def test_a_header_section_past_the_incomplete_event_limit_gets_the_contracts_400(configured, limit):
    """uvicorn's `h11_max_incomplete_event_size` bounds what a request's line and headers may buffer, as it does
    under uvicorn's own protocol (unset: h11's 16 KiB default): a header section still incomplete past it gets the
    contract's JSON 400 and the connection closed; one just inside it is answered. (h11 bounds the bytes buffered
    while an event is incomplete: headers that arrive whole in one read are parsed whatever their size.)"""
    import json

    protocol = request_deadline_protocol(30.0, 30.0)
    padded = REQUEST.replace(b"Host: test", b"Host: test\r\nX-Pad: " + b"p" * (limit + 1024))
    with uvicorn_in_thread(hello, protocol, timeout_keep_alive=30, h11_max_incomplete_event_size=configured) as port:
        with connect(port) as sock:
            sock.sendall(REQUEST.replace(b"Host: test", b"Host: test\r\nX-Pad: " + b"p" * (limit // 2)))
            inside = read_answer(sock, b"ok")
        with connect(port) as sock:
            sock.sendall(padded[:-4])  # past the limit, the blank line that ends the headers not yet sent
            past, _ = read_until_closed(sock)
    assert inside.startswith(b"HTTP/1.1 200 ")
    head, _, body = past.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"].startswith("malformed HTTP request")


def test_the_408_and_the_connection_limits_503_are_reported():
    told: list[tuple[int, str]] = []
    protocol = request_deadline_protocol(DEADLINE_S, 30.0, max_connections=1,
                                         on_refusal=lambda status, kind: told.append((status, kind)))
    with serving(protocol) as port, connect(port) as first:
        first.sendall(b"GET / HT")
        time.sleep(0.2)
        with connect(port) as second:
            assert read_until_closed(second)[0].startswith(b"HTTP/1.1 503 ")
        assert read_until_closed(first)[0].startswith(b"HTTP/1.1 408 ")
    assert told == [(503, "connection_limit"), (408, "request_timeout")]


def test_an_upgrade_the_server_never_grants_is_answered_without_a_warning(port, caplog):
    """`Connection: upgrade` with `Upgrade: websocket` (or any protocol) is answered as the plain request it also
    is, and logs nothing: uvicorn's two warnings a request let any client write to the server's log at will."""
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    for upgrade in (b"websocket", b"h2c", b"foo/1"):
        with connect(port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: upgrade\r\nUpgrade: " + upgrade + b"\r\n\r\n")
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.WARNING]
