"""Serving: `serving/nginx.conf`'s answers where TorchServe's frontend answers for itself, against a stand-in
upstream (a stdlib HTTP server on a free loopback port that answers as TorchServe would and records what reached
it): its own queue-full 503 becomes the contract's (JSON, `Retry-After`, a request id, no Java exception's name),
while the handler's own 4xx and 500 answers pass through unchanged; an upstream that is down is a JSON 502. What a
hostile client sends is checked byte for byte on raw sockets: only `POST /predictions/sentiment`, with no query
and one Content-Type, ever reaches the upstream, whatever path spelling matched it; one address holds at most the
proxy's connection cap; every answer nginx writes itself is JSON with a request id. Skipped where nginx is not
installed (the Docker image installs it); TorchServe itself behind the proxy is `test_conformance.py`'s."""

from __future__ import annotations

import http.client
import json
import re
import selectors
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving.local_servers import free_port
from tests.factories import ROOT
from tests.serving.conftest import nginx_in_front

#: What TorchServe's frontend answers when its job queue is full (as a probe of `make serve` saw it).
QUEUE_FULL = {"code": 503, "type": "ServiceUnavailableException",
              "message": 'Model "sentiment" has no worker to serve inference request. Please use scale workers API '
                         "to add workers."}
#: The handler's own refusal and failure, which the proxy must not touch.
HANDLER_ANSWERS = {
    "refuse": (413, {"error": "texts exceed the maximum of 64 per request", "status": 413, "request_id": "r-1"}),
    "fail": (500, {"error": "internal error while answering this request (logged on the server with its request id)",
                   "status": 500, "request_id": "r-2"}),
    "ok": (200, {"label": "positive", "score": 0.9, "model": "sentiment"}),
}
#: The request line every scoring request must reach the upstream as.
SCORING_LINE = "POST /predictions/sentiment HTTP/1.1"
#: The most error bytes an answer may carry (test_conformance's bound).
MAX_ERROR_BYTES = 512
#: Concurrent clients of one address that must all be served: the queue-full probe's 160 (docs/serving.md), more than
#: benchmarks/serve_load's sweeps (1, 8, 32).
LOAD_CLIENTS = 160


class StandIn(BaseHTTPRequestHandler):
    """Answers as TorchServe would, by the `answer=` of the `Authorization` header (`Bearer probe=<p>,answer=<a>`,
    the one header of the client's besides Content-Type that the proxy passes on): `busy` its frontend's queue-full
    503, `hold` a 200 once the server's `barrier` is full, else one of `HANDLER_ANSWERS`; any method. Records each
    request's line and Content-Type headers under its `probe=`, and every header name it arrived with."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        auth = dict(part.split("=", 1) for part in self.headers.get("Authorization", "").removeprefix("Bearer ")
                    .split(",") if "=" in part)
        probe = auth.get("probe", "")
        self.server.seen[probe] = (self.requestline, self.headers.get_all("Content-Type"))
        self.server.codings[probe] = self.headers.get_all("Content-Encoding")
        self.server.names[probe] = sorted(k.lower() for k in self.headers)
        kind = auth.get("answer", "ok")
        if kind == "hold":
            try:
                self.server.barrier.wait()
                kind = "ok"
            except threading.BrokenBarrierError:
                kind = "fail"
        status, body = (503, QUEUE_FULL) if kind == "busy" else HANDLER_ANSWERS[kind]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if "request_id" in body:
            self.send_header("X-Request-Id", body["request_id"])
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_POST

    def log_message(self, *args: object) -> None:
        pass


def auth(probe: str) -> str:
    """The header that names a request to `StandIn` (which records it by this probe)."""
    return f"Authorization: Bearer probe={probe}"


class StandInServer(ThreadingHTTPServer):
    request_queue_size = 2 * LOAD_CLIENTS  # every client of the load test connects at once

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), StandIn)
        self.port = self.server_address[1]
        self.seen: dict[str, tuple[str, list[str] | None]] = {}
        self.codings: dict[str, list[str] | None] = {}  # the Content-Encoding headers each probe arrived with
        self.names: dict[str, list[str]] = {}  # the header names each probe arrived with
        self.barrier = threading.Barrier(1)


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandInServer]:
    server = StandInServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, answer: str) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=90)
    try:
        conn.request("POST", "/predictions/sentiment", body=b'{"text": "a fine film"}',
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer answer={answer}"})
        resp = conn.getresponse()
        names = [k.lower() for k, _ in resp.getheaders()]
        assert len(names) == len(set(names)), resp.getheaders()  # no header twice (nginx's beside the handler's)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def hop_port(work: Path) -> int:
    """The loopback hop's port in the configuration `nginx_in_front` wrote under `work`."""
    listens = re.findall(r"listen 127\.0\.0\.1:(\d+);", (work / "nginx.conf").read_text())
    assert len(listens) == 2, listens
    return int(listens[1])


def request(method: str, target: str, *headers: str, body: bytes = b"", length: int | None = None) -> bytes:
    """A request's bytes exactly as given (nothing normalised), with `Host`, `Content-Length` (of `body` unless
    `length`) and `Connection: close`."""
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost", *headers,
             f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer from `sock`: status, headers (lower-case names, none twice) and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer's headers; got {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    pairs = [(name.strip().lower(), value.strip()) for name, value in (line.split(":", 1) for line in lines)]
    headers = dict(pairs)
    assert len(headers) == len(pairs), pairs
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def exchange(port: int, raw: bytes, source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """`raw` sent as is on a new connection from `source`, and its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        sock.sendall(raw)
        return read_answer(sock)


def assert_proxy_json(status: int, headers: dict[str, str], body: bytes, want: int) -> dict:
    """An answer nginx wrote itself: `want`, the contract's JSON error with the request id of its header."""
    assert status == want, (status, body)
    assert headers.get("content-type") == "application/json" and len(body) <= MAX_ERROR_BYTES, (headers, body)
    error = json.loads(body)
    assert set(error) == {"error", "status", "request_id"} and error["status"] == want, error
    assert error["request_id"] and headers.get("x-request-id") == error["request_id"], (headers, error)
    return error


def test_the_frontends_queue_full_503_becomes_the_contracts_and_the_handlers_answers_pass(stand_in, tmp_path):
    with nginx_in_front(stand_in.port, tmp_path) as url:
        status, headers, body = post(url, "busy")
        assert status == 503 and headers.get("retry-after") == "1", (status, headers, body)
        error = json.loads(body)
        assert set(error) == {"error", "status", "request_id"} and error["status"] == 503
        assert error["request_id"] and headers.get("x-request-id") == error["request_id"]
        assert b"Exception" not in body and b"scale workers" not in body
        for kind, (want, answer) in HANDLER_ANSWERS.items():
            status, headers, body = post(url, kind)
            assert (status, json.loads(body)) == (want, answer), kind
            if "request_id" in answer:
                assert headers.get("x-request-id") == answer["request_id"], kind
            else:
                assert "x-request-id" not in headers, kind  # the proxy adds none to the handler's answers


def test_an_upstream_that_is_down_is_a_json_502(tmp_path):
    with nginx_in_front(free_port(), tmp_path) as url:  # nothing listens there
        status, headers, body = post(url, "ok")
    assert_proxy_json(status, headers, body, 502)
    assert headers.get("retry-after") == "1"


#: Spellings of the scoring path nginx matches once normalised, that would reach other TorchServe routes if the
#: client's raw URI were passed on (`/ping`, `/explanations`, `/wfpredict`, `/models`), and query strings, which
#: TorchServe hands to the handler as inputs: each must reach the upstream as `SCORING_LINE`.
RAW_TARGETS = (
    "/ping/../predictions/sentiment",
    "/explanations/sentiment/1.0/../../../predictions/sentiment",
    "/ping/%2e%2e/predictions/sentiment",
    "/ping/%2E%2E/predictions/sentiment",
    "/wfpredict/x/../../predictions/sentiment",
    "/models/../predictions/sentiment",
    "/predictions/./sentiment",
    "/predictions//sentiment",
    "/predictions/sentimen%74",
    "/predictions/sentiment?body=x&data=y",
    "/ping/../predictions/sentiment?",
)


def test_only_the_normalised_scoring_path_reaches_the_upstream(stand_in, tmp_path):
    with nginx_in_front(stand_in.port, tmp_path) as url:
        hop = hop_port(tmp_path)
        for port in (port_of(url), hop):  # the hop passes only the scoring path too
            for target in RAW_TARGETS:
                probe = uuid.uuid4().hex
                status, _, body = exchange(port, request("POST", target, auth(probe),
                                                         "Content-Type: application/json", body=b'{"text": "ok"}'))
                assert status == 200, (port, target, body)
                assert stand_in.seen.pop(probe) == (SCORING_LINE, ["application/json"]), (port, target)
        for target in ("/ping", "/models", "/predictions/sentiment/extra", "/predictions/sentiment/.."):
            probe = uuid.uuid4().hex
            status, headers, body = exchange(hop, request("POST", target, auth(probe), body=b"{}"))
            assert_proxy_json(status, headers, body, 404)
            assert probe not in stand_in.seen, target
        probe = uuid.uuid4().hex
        status, headers, body = exchange(hop, request("PUT", "/predictions/sentiment", auth(probe),
                                                      body=b"{}"))
        assert_proxy_json(status, headers, body, 405)
        assert headers.get("allow") == "POST" and probe not in stand_in.seen


def test_exactly_one_content_type_reaches_the_upstream(stand_in, tmp_path):
    """Of two Content-Types TorchServe reads the last and nginx the first: the upstream must get one, the one the
    proxy read, or nothing at all, so `{"text": ...}` declared JSON is never scored as the plain text `{"text": ...}`.
    nginx 1.22 keeps the first in `$content_type` (passed on); 1.23 and later join the two with ", ", which the
    proxy refuses (400) on any version, as it refuses a comma in one Content-Type."""
    cases = {("Content-Type: application/json", "Content-Type: text/plain"): ["application/json"],
             ("Content-Type: text/plain", "Content-Type: application/json"): ["text/plain"],
             ("Content-Type: application/json",): ["application/json"],
             ("Content-Type: application/json, text/plain",): 400,
             (): None}  # none sent, none passed on (the handler's 415), rather than an empty one
    with nginx_in_front(stand_in.port, tmp_path) as url:
        for headers, want in cases.items():
            probe = uuid.uuid4().hex
            status, _, body = exchange(port_of(url), request("POST", "/predictions/sentiment", auth(probe),
                                                             *headers, body=b'{"text": "a wonderful film"}'))
            if want == 400 or (len(headers) == 2 and status == 400):  # refused by the proxy: nothing went upstream
                assert status == 400 and json.loads(body)["request_id"] and probe not in stand_in.seen, headers
                continue
            assert status == 200, (headers, body)
            assert stand_in.seen.pop(probe) == (SCORING_LINE, want), headers


def test_no_content_encoding_reaches_the_upstream(stand_in, tmp_path):
    """A body declared `identity` (the only coding either server takes) goes on without the header, so TorchServe,
    which keeps the last of two, never judges a coding the proxy did not read; any other is the proxy's 415."""
    with nginx_in_front(stand_in.port, tmp_path) as url:
        for headers in (("Content-Encoding: identity",), ("Content-Encoding:  IDENTITY ",), ()):
            probe = uuid.uuid4().hex
            status, _, body = exchange(port_of(url), request(
                "POST", "/predictions/sentiment", auth(probe), "Content-Type: application/json", *headers,
                body=b'{"text": "a wonderful film"}'))
            assert status == 200, (headers, body)
            assert stand_in.seen.pop(probe)[0] == SCORING_LINE and stand_in.codings.pop(probe) is None, headers


def test_only_the_headers_the_handler_reads_reach_the_upstream(stand_in, tmp_path):
    """TorchServe's HTTP layer refuses, with its own 400 (a Java exception's name, no request id), headers nginx
    accepts: over 8 KiB in all, or a control byte in a value. Only Host, Authorization and Content-Type go on (and
    the body's length), so a client's other headers never reach it; those that go on and TorchServe would refuse are
    the contract's 400 here."""
    with nginx_in_front(stand_in.port, tmp_path) as url:
        probe = uuid.uuid4().hex
        pads = [f"X-Pad{i}: {'a' * 4000}" for i in range(3)]  # 12 KB in all: nginx takes it, TorchServe would not
        status, _, body = exchange(port_of(url), request(
            "POST", "/predictions/sentiment", auth(probe), "Content-Type: application/json",
            "X-Note: a\x0bb", "Cookie: c=1", *pads, body=b'{"text": "a wonderful film"}'))
        assert status == 200, body
        assert stand_in.names.pop(probe) == ["authorization", "connection", "content-length", "content-type", "host"]
        stand_in.seen.pop(probe)
        for bad in (auth(probe) + ",x=a\x0cb", auth(probe) + "," + "k" * 3000,
                    "Content-Type: application/json\x0b"):
            status, _, body = exchange(port_of(url), request(
                "POST", "/predictions/sentiment", *([bad] if bad.startswith("Authorization") else
                                                    [auth(probe), bad]),
                body=b'{"text": "a wonderful film"}'))
            assert status == 400 and json.loads(body)["request_id"] and probe not in stand_in.seen, (bad, body)


def test_one_address_past_its_connection_cap_gets_the_contracts_503_and_is_served_again(stand_in, tmp_path):
    """Requests whose body has not come (headers in: nginx counts them) fill the cap of one address; the excess is
    answered the contract's 503 at once, another address is still served, and the held requests are served once
    their bodies come, after which the first address is served again."""
    conf = (ROOT / "serving" / "nginx.conf").read_text()
    match = re.search(r"^\s*limit_conn per_client (\d+);", conf, re.M)
    assert match, "serving/nginx.conf caps no client's requests in flight (limit_conn per_client N)"
    cap = int(match[1])
    excess = 8
    body = b'{"text": "held"}'
    with nginx_in_front(stand_in.port, tmp_path) as url:
        socks = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=30) for _ in range(cap + excess)]
        try:
            for sock in socks:
                sock.sendall(request("POST", "/predictions/sentiment", "Content-Type: application/json",
                                     length=len(body)))
            refused: list[socket.socket] = []
            with selectors.DefaultSelector() as sel:
                for sock in socks:
                    sel.register(sock, selectors.EVENT_READ)
                while len(refused) < excess:
                    ready = sel.select(timeout=60)
                    assert ready, f"{len(refused)} of {excess} connections past the cap of {cap} were answered"
                    for key, _ in ready:
                        status, headers, answer = read_answer(key.fileobj)
                        assert_proxy_json(status, headers, answer, 503)
                        assert headers.get("retry-after") == "1"
                        sel.unregister(key.fileobj)
                        refused.append(key.fileobj)
            held = [sock for sock in socks if sock not in refused]
            assert len(held) == cap
            status, _, answer = exchange(port_of(url), request("POST", "/predictions/sentiment",
                                                               "Content-Type: application/json", body=body),
                                         source="127.0.0.2")
            assert status == 200, answer  # another address is not held back by this one's cap
            for sock in held:
                sock.sendall(body)
            assert [read_answer(sock)[0] for sock in held] == [200] * cap
        finally:
            for sock in socks:
                sock.close()
        status, _, answer = post(url, "ok")
        assert status == 200, answer


def test_the_load_tests_clients_at_once_from_one_address_are_all_served(stand_in, tmp_path):
    """`LOAD_CLIENTS` requests in flight at once from one address (the upstream answers none before all arrived)
    stay under the connection cap and the proxy's worker_connections."""
    stand_in.barrier = threading.Barrier(LOAD_CLIENTS, timeout=120)
    with nginx_in_front(stand_in.port, tmp_path) as url, ThreadPoolExecutor(LOAD_CLIENTS) as pool:
        statuses = list(pool.map(lambda _: post(url, "hold")[0], range(LOAD_CLIENTS)))
    assert statuses == [200] * LOAD_CLIENTS, {s: statuses.count(s) for s in set(statuses)}


#: Requests nginx answers itself (before or instead of the upstream), and the status each must get.
PROXY_ANSWERS = (
    (request("GET", "/ping"), 404),
    (request("POST", "/predictions/sentiment/extra", body=b"{}"), 404),
    (request("POST", "/.proxy/503", body=b"{}"), 404),  # the error pages' own locations are internal
    (request("GET", "/predictions/sentiment"), 405),
    (request("DELETE", "/predictions/sentiment"), 405),
    (request("TRACE", "/predictions/sentiment"), 405),
    (request("TRACE", "/"), 405),
    (request("POST", "/predictions/sentiment", length=2 * 1024 * 1024), 413),
    (request("POST", "/predictions/sentiment?" + "a" * 9000), 414),
    (request("POST", "/predictions/sentiment", "X-Long: " + "a" * 9000), 400),  # a header line over 8 KiB
    (request("POST", "/predictions/sentiment", "Host: other"), 400),  # two Hosts
    (request("POST", "/predictions/sentiment", "Transfer-Encoding: chunked", body=b"{}"), 400),  # and a length
    (request("POST", "/predictions/sentiment", "Transfer-Encoding: gzip, chunked", body=b"{}"), 501),
    (request("OPTIONS", "*"), 400),
    (request("CONNECT", "localhost:8079"), 400),
    (b"GARBAGE\r\n\r\n", 400),
    # a text request line naming HTTP/2 or later: TorchServe's frontend would read it as HTTP/1.1
    (request("POST", "/predictions/sentiment", body=b"{}").replace(b" HTTP/1.1\r\n", b" HTTP/2.0\r\n", 1), 505),
    (request("POST", "/predictions/sentiment", body=b"{}").replace(b" HTTP/1.1\r\n", b" HTTP/3.7\r\n", 1), 505),
    # bodies TorchServe's frontend would decode itself before the handler (its 500s, seconds on a large one)
    (request("POST", "/predictions/sentiment", "Content-Type: application/x-www-form-urlencoded",
             body=b"text=%zz"), 415),
    (request("POST", "/predictions/sentiment", 'Content-Type: multipart/form-data; boundary="', body=b"x"), 415),
    (request("POST", "/predictions/sentiment", "Content-Type: Multipart/Mixed; boundary=b", body=b"x"), 415),
    (request("POST", "/predictions/sentiment", "Content-Type:  APPLICATION/X-WWW-FORM-URLENCODED; charset=utf-8",
             body=b"a&" * 450_000), 415),  # half a million empty fields: seconds of TorchServe's frontend
    # a coding neither the handler nor nginx decodes, alone, listed or after identity
    (request("POST", "/predictions/sentiment", "Content-Type: application/json", "Content-Encoding: gzip",
             body=b"{}"), 415),
    (request("POST", "/predictions/sentiment", "Content-Type: application/json", "Content-Encoding: identity, br",
             body=b"{}"), 415),
    (request("POST", "/predictions/sentiment", "Content-Type: application/json", "Content-Encoding: gzip",
             "Content-Encoding: identity", body=b"{}"), 415),
)


def test_every_answer_the_proxy_writes_itself_is_json_with_a_request_id(stand_in, tmp_path):
    stand_in.seen.clear()
    with nginx_in_front(stand_in.port, tmp_path) as url:
        for raw, want in PROXY_ANSWERS:
            status, headers, body = exchange(port_of(url), raw)
            assert_proxy_json(status, headers, body, want)
            assert b"nginx" not in body and b"<html" not in body, raw[:80]
            if want == 405:
                assert headers.get("allow") == "POST"
    assert not stand_in.seen  # none of them reached the upstream


def test_every_body_in_the_configuration_is_the_contracts_json_with_a_request_id():
    """What the running tests cannot reach cheaply (a 504 after 70 s, a 500 of nginx's own) is checked in the
    file: each `return` either writes a JSON error with its status and `$request_id` from a block that sends the
    same id as `X-Request-Id`, or is a bare status its server answers through an error page."""
    conf = (ROOT / "serving" / "nginx.conf").read_text()
    servers = re.split(r"\n    server \{", conf)[1:]
    assert len(servers) == 2
    for server in servers:
        error_pages = {int(code) for code in re.findall(r"^\s*error_page (\d{3}) ", server, re.M)}
        for block in re.split(r"\n\s*location ", server)[1:]:
            for code, text in re.findall(r"return (\d{3})(?: '([^']*)')?;", block):
                if not text:
                    assert int(code) in error_pages, (code, block)
                    continue
                body = json.loads(text.replace("$request_id", "r-1"))
                assert set(body) == {"error", "status", "request_id"} and body["status"] == int(code), block
                assert body["request_id"] == "r-1" and "add_header X-Request-Id $request_id always;" in block
