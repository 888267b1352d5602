"""What the MLflow server's connection protocol (`serving.request_deadline`) answers itself where h11 has no request
to frame an answer for or the app never hears of the request, and the marks and limits the app shares with it:
`contract_middleware` reads `RETRY_AFTER_S` and `answered_by_protocol` without importing uvicorn."""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

#: Seconds a client is asked to wait after a 503: a connection over the protocol's limit, and the MLflow server's
#: overload answer.
RETRY_AFTER_S = 1
#: Seconds a connection refused at the limit stays half-open after its 503, its bytes read and dropped: closing a
#: socket with unread bytes sends a reset, and a client that sent its request at once could lose the 503 to it.
REFUSAL_LINGER_S = 1.0


def raw_response(status: HTTPStatus, error: str, headers: list[tuple[str, str]], rid: str) -> bytes:
    """An answer written as bytes where h11 has no request to frame one for (headers too slow, a connection past the
    limit): the contract's JSON error `{"error", "status", "request_id"}` with `headers` (the served model's) and
    `X-Request-Id`, the connection closed after it."""
    body = json.dumps({"error": error, "status": status.value, "request_id": rid}).encode()
    lines = [f"HTTP/1.1 {status.value} {status.phrase}".encode(), b"content-type: application/json",
             f"content-length: {len(body)}".encode(),
             *(f"{k.lower()}: {v}".encode() for k, v in [*headers, ("x-request-id", rid)]), b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def over_limit_response(max_connections: int, headers: list[tuple[str, str]], rid: str) -> bytes:
    """The 503 a connection past `max_connections` gets before anything of its request is read, with `Retry-After`."""
    return raw_response(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds its limit of {max_connections} connections; "
                        f"retry after {RETRY_AFTER_S} s", [("retry-after", str(RETRY_AFTER_S)), *headers], rid)


def headers_timeout_response(headers: list[tuple[str, str]], rid: str) -> bytes:
    """The 408 for a request whose line and headers did not arrive in time."""
    return raw_response(HTTPStatus.REQUEST_TIMEOUT, "the request line and headers did not arrive in time", headers, rid)


#: Pieces (h11 data events) a request's body may arrive in; a 1 MB body in 1,448-byte TCP segments is about 700.
MAX_BODY_PIECES = 4096
#: Average bytes a piece must carry once a body is past `max_body_pieces` (a full TCP segment carries ~1,448).
MIN_PIECE_BYTES = 256
#: Key of a request's ASGI `scope["state"]` set when the protocol answered that request itself (its body past the
#: piece budget, or unreadable): the app, which then hears only `http.disconnect`, must not count it again.
PROTOCOL_REFUSED = "request_deadline.refused"


def answered_by_protocol(scope: Mapping[str, Any]) -> bool:
    """Whether the connection's protocol answered this request itself (a body past its piece budget, or bytes after
    the headers that are no HTTP: `PROTOCOL_REFUSED` in its ASGI scope's state) and closed the connection."""
    return bool((scope.get("state") or {}).get(PROTOCOL_REFUSED))


#: The 400 for bytes that are not an HTTP/1.1 request h11 can read: it names no part of them.
MALFORMED = "malformed HTTP request: its request line, headers or body framing could not be read"
