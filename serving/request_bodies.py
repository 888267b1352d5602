"""Reading a scoring request's body under the contract's limits (`read_body`): refused (413) as soon as it is known to
be too large, 408 when it is not all in in time, and what is left of a refused body read and dropped so the
client can read its answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pipeline.deployment.protocol import RequestError

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

#: A refused (413) body up to this size is read to its end before the answer, so the client can read the 413.
DISCARD_BODY_BYTES = 8 * 1024 * 1024
#: Seconds, in all, spent reading and dropping a refused body before answering anyway.
DISCARD_WAIT_S = 2.0


class ClientGone(RequestError):
    """The client hung up before its body was in: a 400 that is never delivered (`CLIENT_CLOSED` in `/metrics`)."""


async def read_body(headers: dict[str, str], receive: Receive, limit: int, timeout_s: float,
                    waits_for_continue: bool = False) -> bytes:
    """The request body (`headers`: lower-case names), refused (413) as soon as it is known to exceed `limit` bytes
    (what is left of it is read and dropped first, `discard_body`, unless the client `waits_for_continue`:
    `serving.request_line.waits_for_continue`), 408 when it is not all in within `timeout_s` seconds, `ClientGone`
    when the client hung up first."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        if not waits_for_continue:  # a client waiting for "100 Continue" has sent nothing to drop
            await discard_body(headers, receive)  # (and reading would invite it to upload)
        raise RequestError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit}")
    deadline = asyncio.get_running_loop().time() + timeout_s
    chunks, size = [], 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s "
                                    f"({size} bytes received)") from None
        if message["type"] == "http.disconnect":
            raise ClientGone(400, "the client closed the connection before the body was complete")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            if message.get("more_body", False):
                await discard_body(headers, receive)
            raise RequestError(413, f"request body of more than {limit} bytes exceeds the limit of {limit}")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def discard_body(headers: dict[str, str], receive: Receive) -> None:
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

