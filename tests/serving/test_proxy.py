"""Serving: `serving/nginx.conf`'s answers where TorchServe's frontend answers for itself, against a stand-in
upstream (a stdlib HTTP server on a free loopback port that answers as TorchServe would): its own queue-full 503
becomes the contract's (JSON, `Retry-After`, a request id, no Java exception's name), while the handler's own
4xx and 500 answers pass through unchanged; an upstream that is down is a JSON 502. Skipped where nginx is not
installed (the Docker image installs it); TorchServe itself behind the proxy is `test_conformance.py`'s."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.factories import free_port
from tests.serving.conftest import nginx_in_front

#: What TorchServe's frontend answers when its job queue is full (as a probe of `make serve` saw it).
QUEUE_FULL = {"code": 503, "type": "ServiceUnavailableException",
              "message": 'Model "sentiment" has no worker to serve inference request. Please use scale workers API '
                         "to add workers."}
#: The handler's own refusal and failure, which the proxy must not touch.
HANDLER_ANSWERS = {
    "refuse": (413, {"error": "texts exceed the maximum of 64 per request", "status": 413, "request_id": "r-1"}),
    "fail": (500, {"error": "internal error while scoring this request (logged on the server)", "status": 500,
                   "request_id": "r-2"}),
    "ok": (200, {"label": "positive", "score": 0.9, "model": "sentiment"}),
}


class StandIn(BaseHTTPRequestHandler):
    """Answers as TorchServe would, by the `X-Answer` header: `busy` its frontend's queue-full 503, else one of
    `HANDLER_ANSWERS`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        kind = self.headers.get("X-Answer", "ok")
        status, body = (503, QUEUE_FULL) if kind == "busy" else HANDLER_ANSWERS[kind]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if "request_id" in body:
            self.send_header("X-Request-Id", body["request_id"])
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def stand_in() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, answer: str) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/predictions/sentiment", body=b'{"text": "a fine film"}',
                     headers={"Content-Type": "application/json", "X-Answer": answer})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_the_frontends_queue_full_503_becomes_the_contracts_and_the_handlers_answers_pass(stand_in, tmp_path):
    with nginx_in_front(stand_in, tmp_path) as url:
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


def test_an_upstream_that_is_down_is_a_json_502(tmp_path):
    with nginx_in_front(free_port(), tmp_path) as url:  # nothing listens there
        status, headers, body = post(url, "ok")
    assert status == 502 and headers.get("retry-after") == "1" and json.loads(body)["status"] == 502, body
