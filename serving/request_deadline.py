"""A deadline on a request's line and headers for uvicorn's h11 server (`python -m serving.mlflow_server`).

uvicorn times out only the idle time between two requests of a keep-alive connection (`timeout_keep_alive`), and
any byte received cancels that timer: a client that opens connections and sends a request's headers a byte at a
time, or nothing at all, holds each connection as long as it likes (slow HTTP, "slowloris"), up to the server's
connection limit, after which every new client is refused (uvicorn's issue 157 lists the missing timeouts). ASGI
middleware cannot help: it is called only once the headers are in. The protocol class here arms a deadline when a
connection opens and again when an answer has gone out (the next request may follow on the same connection), and
disarms it once a request's headers are parsed; the body's own deadline is the middleware's (`body_timeout_s`). A
connection whose request has begun to arrive but whose headers are still incomplete at the deadline gets a 408
and is closed; one that sent nothing (a new connection, or a kept-alive one between requests) is closed without an
answer, as uvicorn's keep-alive timeout closes it: a pooled client then opens a new connection for its next request
instead of reading an answer to a request it has not sent.

An answer can go out before its request's body is all in (a 413 from the declared length, a 404 or a 503): the
rest of that body is read and dropped (uvicorn's h11 protocol does so) until the same deadline, then the
connection is closed. Without it, a client that kept sending a declared body a byte at a time after its answer
held the connection for as long as it liked (uvicorn cancels its keep-alive timer on every byte received).

Writing has a deadline too: uvicorn waits for a full send buffer to drain before each part of an answer, with no
limit, so a client that sends requests and reads none of the answers held its request (in the MLflow server, a
scoring slot) for as long as it kept the connection open. When the transport asks to stop writing (its buffer is
full), a timer of `send_timeout_s` starts; when the client has not read enough to resume writing by then, the
connection is dropped (`abort`: a plain close would wait for the unread buffer to drain first), and the app's
pending send returns.

Two costs of a request are bounded below the app as well. A body's pieces (h11's data events: a chunk of a chunked
body, or what one read of the socket delivered) each cost the event loop a few microseconds whatever their size, so
a 1 MB body sent as a million 1-byte chunks held the loop, and every other client, for seconds. Past
`max_body_pieces` pieces, a body whose pieces average under `MIN_PIECE_BYTES` is answered 400 and the connection
closed: the loop's cost is then bounded per byte received, and an upload in ordinary TCP segments (about 1,448
bytes each), however large, is never refused here (a body over the limit gets the app's 413). And what uvicorn would
answer in plain text (a request h11 cannot parse: a bad Content-Length, a bad chunk size, no Host) is the
contract's JSON 400 with a request id and the model's headers. `on_refusal(status, kind)` is told of every answer
given here (the server's `/metrics` counts them with the app's).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.protocol_answers import (
    MALFORMED,
    MAX_BODY_PIECES,
    MIN_PIECE_BYTES,
    PROTOCOL_REFUSED,
    REFUSAL_LINGER_S,
    headers_timeout_response,
    over_limit_response,
)
from serving.request_ids import new_request_id, request_id

log = logging.getLogger(__name__)  # a child of "serving", which the server logs to its file


@dataclass(frozen=True)
class DeadlineSettings:
    """What one server's protocol class enforces (`request_deadline_protocol` says what each does)."""

    headers_timeout_s: float
    send_timeout_s: float
    max_connections: int | None = None
    refusal_headers: tuple[tuple[str, str], ...] = ()
    max_body_pieces: int = MAX_BODY_PIECES
    on_refusal: Callable[[int, str], None] | None = None


def request_deadline_protocol(headers_timeout_s: float, send_timeout_s: float, max_connections: int | None = None,
                              refusal_headers: list[tuple[str, str]] | None = None,
                              max_body_pieces: int = MAX_BODY_PIECES,
                              on_refusal: Callable[[int, str], None] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class with a `headers_timeout_s` deadline on each request's line and headers, a
    `send_timeout_s` one on a client that stopped reading and a budget of `max_body_pieces` small pieces per request
    body (see the module doc), for `uvicorn.run(app, http=...)` (uvicorn's own options, such as
    `h11_max_incomplete_event_size`, still apply).

    With `max_connections`, a connection that opens while that many are open gets `over_limit_response` (with
    `refusal_headers`) and is closed at once: uvicorn's own `limit_concurrency` answers a plain-text 503 without
    `Retry-After` and only once a request's headers are in (leave it unset with this). `refusal_headers` also go
    out with the 400 for a request h11 cannot read and the 408 for headers too slow; `on_refusal(status, kind)` hears
    of each of these answers. Every one of them names a request id: the request's (`serving.request_ids`, as the app
    names it) where its headers were read, else a new one."""
    settings = DeadlineSettings(headers_timeout_s, send_timeout_s, max_connections, tuple(refusal_headers or ()),
                                max_body_pieces, on_refusal)
    # uvicorn builds one protocol object a connection from the class alone, so the settings ride on a subclass
    return type("RequestDeadlineProtocol", (RequestDeadlineProtocol,), {"settings": settings})


class TooManyPieces(h11.RemoteProtocolError):
    """A request body past its budget of pieces whose pieces average under `MIN_PIECE_BYTES`."""


class PieceBudget(h11.Connection):
    """h11's server connection that counts each request's body pieces and their bytes, and stops a body past
    `max_body_pieces` pieces whose pieces average under `MIN_PIECE_BYTES`."""

    pieces = 0
    piece_bytes = 0
    over_budget = False  # the last error was the budget's (uvicorn's 400 for it is told nothing else)

    def __init__(self, max_body_pieces: int, **options: Any) -> None:
        super().__init__(h11.SERVER, **options)
        self.max_body_pieces = max_body_pieces

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            self.pieces = self.piece_bytes = 0
        elif isinstance(event, h11.Data):
            self.pieces += 1
            self.piece_bytes += len(event.data)
            # what costs the loop is many tiny pieces; a large body in full TCP segments is not refused here
            if self.pieces > self.max_body_pieces and self.piece_bytes < self.pieces * MIN_PIECE_BYTES:
                self.over_budget = True
                raise TooManyPieces(f"request body in more than {self.max_body_pieces} small pieces")
        return event


class RequestDeadlineProtocol(H11Protocol):
    """`H11Protocol` whose connections must deliver each request's headers within `settings.headers_timeout_s` and
    its body in pieces that stay within the budget (`PieceBudget`), and read their answers at least every
    `settings.send_timeout_s` once the send buffer is full. Served as the subclass `request_deadline_protocol`
    makes, which sets `settings`."""

    settings: ClassVar[DeadlineSettings]

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        # uvicorn's own connection, counted: its size limit where configured, else h11's default (uvicorn
        # reads that default from h11's private module; h11's keyword default is the same value)
        size = config.h11_max_incomplete_event_size
        options = {} if size is None else {"max_incomplete_event_size": size}
        self.conn: PieceBudget = PieceBudget(self.settings.max_body_pieces, **options)

    deadline: asyncio.TimerHandle | None = None
    request_begun = False  # bytes of a request arrived since the deadline was armed
    # the answered request (uvicorn's cycle) whose unread rest of a body the deadline ends; None: the deadline
    # is on the next request's headers
    lingering_for: Any = None
    send_deadline: asyncio.TimerHandle | None = None  # armed while the transport's send buffer is full
    refusing = False  # refused at the connection limit: what arrives is dropped until the connection closes

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # counted in the server's connections from here
        if self.settings.max_connections and len(self.connections) > self.settings.max_connections:
            rid = new_request_id()
            log.warning("request %s: refusing the connection of %s: %d connections open, the limit (503)", rid,
                        self._peer(), len(self.connections) - 1)
            self.refusing = True
            transport.write(over_limit_response(self.settings.max_connections, self.settings.refusal_headers, rid))
            if transport.can_write_eof():  # half-closed: the 503 goes out, what the client sent is read
                transport.write_eof()
                self.loop.call_later(REFUSAL_LINGER_S, transport.close)
            else:
                transport.close()
            self._refused(503, "connection_limit")
            return
        self._arm()

    def eof_received(self) -> bool | None:
        if self.refusing:
            self.transport.close()
        return super().eof_received()

    def send_400_response(self, msg: str) -> None:
        """The contract's JSON 400 where uvicorn would answer plain text (`msg`, uvicorn's, is not used): for
        bytes h11 cannot read as a request, or a body past its piece budget. The connection is closed after it,
        and without it where an answer is already on its way (nothing more can be framed there)."""
        over_budget = self.conn.over_budget
        reading = self.cycle is not None and not self.cycle.response_complete  # a request the app is reading
        rid = request_id(self.cycle.scope) if reading else new_request_id()
        why = (f"the request body came in more than {self.conn.max_body_pieces} pieces (chunks or reads) of under "
               f"{MIN_PIECE_BYTES} bytes on average: send it in larger chunks") if over_budget else MALFORMED
        body = json.dumps({"error": why, "status": 400, "request_id": rid}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", rid.encode()),
                   *((k.lower().encode(), v.encode()) for k, v in self.settings.refusal_headers),
                   (b"connection", b"close")]
        try:
            answer = [self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")),
                      self.conn.send(h11.Data(data=body)), self.conn.send(h11.EndOfMessage())]
        except h11.LocalProtocolError:
            answer = []
        if answer:
            log.warning("request %s from %s: %s (400)", rid, self._peer(), why)
            self._refused(400, "too_many_pieces" if over_budget else "malformed_http")
            if reading:
                self.cycle.scope.setdefault("state", {})[PROTOCOL_REFUSED] = True
                # the app hears `http.disconnect` from here on, and uvicorn sends nothing more for it (its 500 for
                # an app that answered nothing would meet h11's closed state: an exception in its task, logged
                # with its traceback when the task is collected); `connection_lost` would say so only later
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            for part in answer:
                self.transport.write(part or b"")
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refusing:
            return  # read and dropped: the 503 has gone out
        self.request_begun = self.request_begun or bool(data)
        try:
            super().data_received(data)
        except h11.LocalProtocolError:
            # bytes h11 cannot parse after an answer went out (the rest of a refused chunked body, malformed):
            # uvicorn's 400 for them cannot be framed once a response is complete, and nothing more can be
            # said on this connection
            self.transport.close()
            return
        if self.lingering_for is not None:
            if self.cycle is self.lingering_for and self.conn.their_state is not h11.IDLE:
                return  # still the rest of the answered request's body: its deadline stands
            self._arm()  # that body ended (uvicorn then starts the next request): the next headers' deadline
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # a request's headers are in: its body is the app's to time

    def on_response_complete(self) -> None:
        answered = self.cycle
        super().on_response_complete()  # starts a pipelined request already received (a new cycle)
        if self.transport.is_closing():
            return
        if self.cycle is not answered:
            self._disarm()  # that pipelined request's headers are in: its body is the app's to time
        elif self.conn.their_state is h11.IDLE:
            # the connection stays open for the next request: its headers get the same deadline, and a part of
            # them already received counts as a request begun (a 408 at the deadline)
            self._arm()
            self.request_begun = bool(self.conn.trailing_data[0])
        elif self.conn.their_state is h11.SEND_BODY:  # answered before its body was all in: dropped until then
            self._arm(lingering_for=answered)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_deadline is None:
            self.send_deadline = self.loop.call_later(self.settings.send_timeout_s, self._send_deadline_passed)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_deadline()

    def _unsupported_upgrade_warning(self) -> None:
        """Nothing logged for an `Upgrade` this server never grants: the request is answered as the plain HTTP
        request it also is (RFC 9110 7.8). uvicorn's two warnings a request, one advising a WebSocket library the
        server does not use, let any client write to the log at will."""

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_deadline()
        super().connection_lost(exc)  # also ends a send waiting for the buffer to drain

    def _stop_send_deadline(self) -> None:
        if self.send_deadline is not None:
            self.send_deadline.cancel()
            self.send_deadline = None

    def _send_deadline_passed(self) -> None:
        self.send_deadline = None
        log.warning("dropping the connection of %s: it read none of its answers for %g s", self._peer(),
                    self.settings.send_timeout_s)
        self.transport.abort()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _arm(self, lingering_for: Any = None) -> None:
        self._disarm()
        self.request_begun = False
        self.lingering_for = lingering_for
        self.deadline = self.loop.call_later(self.settings.headers_timeout_s, self._deadline_passed)

    def _disarm(self) -> None:
        self.lingering_for = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _deadline_passed(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.lingering_for is not None:  # the answer went out long ago; what the client still sends is not read
            self.transport.close()
            return
        if self.conn.their_state is not h11.IDLE:
            return
        if self.request_begun:
            rid = new_request_id()
            log.warning("request %s: closing the connection of %s: no complete request line and headers "
                        "within %g s", rid, self._peer(), self.settings.headers_timeout_s)
            if self.cycle is None or self.cycle.response_complete:  # nothing of an answer is on its way
                self.transport.write(headers_timeout_response(self.settings.refusal_headers, rid))
                self._refused(408, "request_timeout")
        self.transport.close()

    def _refused(self, status: int, kind: str) -> None:
        if self.settings.on_refusal is not None:
            self.settings.on_refusal(status, kind)
