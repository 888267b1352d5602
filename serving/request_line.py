"""What a request's line and headers alone decide, before its body (`refusal`): the MLflow server's routes and the
limits on its URL and headers (`serving.contract_middleware` answers what this finds)."""

from __future__ import annotations

import collections
import re
import urllib.parse
from collections.abc import MutableMapping
from typing import Any

from pipeline.deployment.media_types import HEADER_VALUE_TRIM, OWS
from pipeline.deployment.protocol import RequestError

Scope = MutableMapping[str, Any]
Headers = list[tuple[bytes, bytes]]

INVOCATIONS = "/invocations"
#: Paths and the methods answered on them; everything else is 404 (unknown path) or 405 (other method).
ROUTES = {INVOCATIONS: "POST", "/ping": "GET", "/health": "GET", "/version": "GET", "/ready": "GET",
          "/metrics": "GET"}
MAX_URL_BYTES = 2048
MAX_HEADER_BYTES = 8192
CLOSE = (b"connection", b"close")
#: Headers a request may send once only (lower-case, as uvicorn hands them over); a repeat is a 400.
SINGLE_HEADERS = frozenset({b"content-type", b"content-encoding"})


#: An absolute-form request target's scheme and authority (`http://host:port`), as a proxy sends a request.
ABSOLUTE_FORM = re.compile(rb"(?i)https?://[^/?#]*")


def read_origin_form(scope: Scope) -> None:
    """Read an absolute-form target (`POST http://127.0.0.1:5001/invocations`: what a client sends through a forward
    proxy, and what RFC 9112 3.2.2 says a server must accept) as its path, the way nginx and TorchServe read it, in
    `scope` itself (the protocol marks the request's own scope when it answers it: a copy would not hear of it).
    Any other target is left as it is: an origin-form path, or one `refusal` refuses."""
    raw_path = scope.get("raw_path") or b""
    authority = ABSOLUTE_FORM.match(raw_path)
    # a target over the URL limit is left whole, for `refusal`'s 414: its authority counts against the limit too
    if authority is not None and url_bytes(scope) <= MAX_URL_BYTES:
        path = raw_path[authority.end():] or b"/"  # uvicorn split the query off already
        scope["raw_path"], scope["path"] = path, urllib.parse.unquote(path.decode("latin-1"))


def expectations(scope: Scope) -> set[str]:
    """Every expectation of every `Expect` line, lower-cased (h11 invites the body when any of them is
    100-continue); empty list elements are none (RFC 9110 5.6.1), and only space and tab surround one (the
    value's ends trimmed as TorchServe's HTTP layer trims them, `HEADER_VALUE_TRIM`)."""
    return {e.strip(OWS).lower() for k, v in scope.get("headers", []) if k.lower() == b"expect"
            for e in v.decode("latin-1").strip(HEADER_VALUE_TRIM).split(",")} - {""}


def waits_for_continue(scope: Scope) -> bool:
    """The client waits for "100 Continue" before it uploads its body (uvicorn sends it on the first read), so a
    body refused unread was never sent. An HTTP/1.0 client's expectation is ignored (RFC 9110 10.1.1, as h11 does):
    it sends its body at once, and a refused one is read and dropped like any other."""
    return scope.get("http_version") != "1.0" and "100-continue" in expectations(scope)


def unsent_body_closes(scope: Scope, extra: Headers | None = None) -> Headers | None:
    """`extra` with `Connection: close` where the client waits to be invited to send its body (`waits_for_continue`)
    and is answered before the body is read: the body it holds back is never sent, and the connection's next bytes
    would be read as it, so the connection is not reused and the answer says so (RFC 9110 10.1.1)."""
    if not waits_for_continue(scope) or CLOSE in (extra or []):
        return extra
    return [*(extra or []), CLOSE]


def url_bytes(scope: Scope) -> int:
    """The request target's size as the client sent it: its path (or absolute form) and query string."""
    raw_path = scope.get("raw_path") or scope.get("path", "").encode()
    return len(raw_path) + len(scope.get("query_string") or b"")


def refusal(scope: Scope) -> tuple[RequestError, Headers | None] | None:
    """What is wrong with a request before its body, from its line and headers alone, with the answer's extra
    headers: an HTTP major version other than 1 (505; 0 is a 400), no Host above HTTP/1.0 (400), its URL or headers
    too large (414, 431), a target that is no path (400), an unknown path (404), another method (405), an
    expectation other than 100-continue (417), a header sent twice that must be sent once or two framings (400).
    None: nothing."""
    path, method = scope.get("path", ""), scope.get("method", "")
    raw_path = scope.get("raw_path") or path.encode()
    version = str(scope.get("http_version", "1.1"))
    if version.startswith("0."):  # nginx's parser, too, reads no request line of major version 0
        return RequestError(400, "malformed request line: HTTP/0.x is no HTTP version this server reads"), [CLOSE]
    if not version.startswith("1."):
        # h11 reads any `HTTP/<digit>.<digit>` line with HTTP/1.1 framing; `HTTP/2.0` in a text request line is no
        # HTTP/2 (whose connections open with a binary preface): refused as nginx refuses it (RFC 9110 15.6.6), the
        # connection kept, so a body on its way is read and dropped as after a 404, not cut off by a reset
        return RequestError(505, "HTTP version not supported: send HTTP/1.1 (or 1.0)"), None
    raw_headers: Headers = scope.get("headers", [])
    names = {k.lower() for k, _ in raw_headers}
    if version not in ("1.0", "1.1") and b"host" not in names:
        # h11 asks a Host of HTTP/1.1 alone, nginx of every version above 1.0 (a 1.2 line is read as 1.1)
        return RequestError(400, "a Host header is required"), [CLOSE]
    if (size := url_bytes(scope)) > MAX_URL_BYTES:
        return RequestError(414, f"URL of {size} bytes exceeds the limit of {MAX_URL_BYTES}"), None
    header_bytes = sum(len(k) + len(v) + 4 for k, v in raw_headers)
    if header_bytes > MAX_HEADER_BYTES:
        return RequestError(431, f"request headers of {header_bytes} bytes exceed the limit of "
                                 f"{MAX_HEADER_BYTES}"), None
    if not raw_path.startswith(b"/"):  # `%2Finvocations`, `*`: not a path
        return RequestError(400, "the request target must be a path beginning with /"), [CLOSE]
    allowed = ROUTES.get(path)
    if allowed is None:
        return RequestError(404, "no such path; scoring is POST /invocations"), None
    if method != allowed and not (method == "HEAD" and allowed == "GET"):  # HEAD wherever GET (RFC 9110 9.3.2)
        methods = f"{allowed}, HEAD" if allowed == "GET" else allowed
        return RequestError(405, f"method not allowed on this path; use {allowed}"), [(b"allow", methods.encode())]
    if expectations(scope) - {"100-continue"}:
        return RequestError(417, "the only expectation this server meets is 100-continue"), [CLOSE]
    counts = collections.Counter(k.lower() for k, _ in raw_headers if k.lower() in SINGLE_HEADERS)
    if repeated := sorted(k for k, n in counts.items() if n > 1):
        # two Content-Types (or codings): a proxy in front may have read the first while this server would read the
        # last, so the body would be checked as one thing and scored as another
        names_sent = " and ".join(k.decode("latin-1").title() for k in repeated)
        return RequestError(400, f"{names_sent} sent more than once: send it once"), [CLOSE]
    if b"content-length" in names and b"transfer-encoding" in names:
        # two framings (h11 reads the chunks, the length would size the body): a request-smuggling shape that no
        # honest client sends; answered and closed, its body unread
        return RequestError(400, "both Content-Length and Transfer-Encoding: send one of them"), [CLOSE]
    return None
