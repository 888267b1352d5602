"""Request ids of the MLflow server: the client's `X-Request-Id` when it is short and plain, else a new one, kept in
the request's ASGI scope so the connection's protocol (`serving.request_deadline`, which may answer a request
itself while its body arrives) and the app (`serving.contract_middleware`) name a request by the same id."""

from __future__ import annotations

import re
import uuid
from collections.abc import MutableMapping
from typing import Any

from pipeline.deployment.protocol import REQUEST_ID_HEADER

#: A client's request id is echoed only when it is this short and plain (never a header or log injection).
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
#: Key of the request's id in its ASGI `scope["state"]`.
REQUEST_ID_STATE = "request_ids.id"
_HEADER = REQUEST_ID_HEADER.lower().encode()


def new_request_id() -> str:
    """A random id, for a request that sent none usable (or that could not be read)."""
    return uuid.uuid4().hex


def request_id(scope: MutableMapping[str, Any]) -> str:
    """The request's id: the client's `X-Request-Id` when it is short and plain (`SAFE_REQUEST_ID`), else a new
    random one; decided once per request and kept in `scope["state"]`, so whoever asks next gets the same."""
    state = scope.get("state")
    if state is None:
        state = scope["state"] = {}
    if REQUEST_ID_STATE not in state:
        state[REQUEST_ID_STATE] = _client_id(scope.get("headers", [])) or new_request_id()
    return str(state[REQUEST_ID_STATE])


def _client_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for key, value in headers:
        if key.lower() == _HEADER:
            sent = value.decode("latin-1")
            return sent if SAFE_REQUEST_ID.fullmatch(sent) else None
    return None
