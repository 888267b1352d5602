"""The serving load's clients (`benchmarks.serve_load`): where and how each server is asked (`Endpoint`), one
client's kept-open HTTP/1.1 connection (`Connection`), waiting for a server to answer, and the malformed mix."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def malformed_bodies(max_body_bytes: int, max_texts: int,
                     server: str = "torchserve") -> list[tuple[str, bytes, str]]:
    """(kind, body, content type) of requests the endpoint must refuse with a 4xx, one per kind of poison, in
    the request format of `server` (TorchServe's `{"text"}`/`{"texts"}`, MLflow's `dataframe_records`)."""
    if server == "mlflow":
        def one(text_json: bytes) -> bytes:
            return b'{"dataframe_records": [{"text": ' + text_json + b"}]}"

        many = json.dumps({"dataframe_records": [{"text": "a"}] * (max_texts + 1)}).encode()
    else:
        def one(text_json: bytes) -> bytes:
            return b'{"text": ' + text_json + b"}"

        many = json.dumps({"texts": ["a"] * (max_texts + 1)}).encode()
    return [
        ("deep-nesting", b"[" * 1200 + b"]" * 1200, "application/json"),
        ("huge-integer", one(b"1" * 5000), "application/json"),
        ("lone-surrogate", one(b'"bad \\ud800 surrogate"'), "application/json"),
        ("json-scalar", b"true", "application/json"),
        ("nan", one(b"NaN"), "application/json"),
        ("invalid-utf8", b"\xff\xfe not text", "text/plain"),
        ("not-a-string", one(b"42"), "application/json"),
        ("null-text", one(b"null"), "application/json"),
        ("oversized", one(json.dumps("x" * (max_body_bytes + 1)).encode()), "application/json"),
        ("too-many-texts", many, "application/json"),
    ]


@dataclass(frozen=True)
class Endpoint:
    """Where and how one server is asked for one review's label."""

    server: str
    url: str
    key: str | None = None  # TorchServe's inference key

    @property
    def path(self) -> str:
        return "/invocations" if self.server == "mlflow" else "/predictions/sentiment"

    def body(self, text: str) -> bytes:
        payload = {"dataframe_records": [{"text": text}]} if self.server == "mlflow" else {"text": text}
        return json.dumps(payload).encode()

    def answered(self, answer: Any) -> bool:
        """A label for the one review sent."""
        if self.server == "mlflow":
            preds = answer.get("predictions") if isinstance(answer, dict) else None
            return isinstance(preds, list) and len(preds) == 1 and isinstance(preds[0], dict) and "label" in preds[0]
        return isinstance(answer, dict) and "label" in answer


class Connection:
    """One client's HTTP/1.1 connection to the endpoint. With `reuse` (the default) it stays open across
    requests, as pooled clients (`requests.Session`, httpx, a load balancer's upstream pool) keep it, and is
    reopened after the server closes it or after an error; a request whose reused connection turns out to have
    been closed by the server before it answered is sent once more on a new one, as urllib3 does (counted in
    `reconnects`). Without `reuse`, each request opens and closes its own connection."""

    def __init__(self, endpoint: Endpoint, reuse: bool = True, timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(endpoint.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.endpoint, self.reuse, self.timeout = endpoint, reuse, timeout
        self.conn: http.client.HTTPConnection | None = None
        self.opened = 0
        self.reconnects = 0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def post(self, body: bytes, content_type: str) -> tuple[int | None, Any]:
        """(status, parsed JSON of a 200 answer or None); (None, None) when no answer came."""
        headers = {"Content-Type": content_type}
        if self.endpoint.key:
            headers["Authorization"] = f"Bearer {self.endpoint.key}"
        if not self.reuse:
            headers["Connection"] = "close"
        for attempt in range(2):
            fresh = self.conn is None
            if fresh:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                self.opened += 1
            try:
                self.conn.request("POST", self.endpoint.path, body=body, headers=headers)
                resp = self.conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if fresh or attempt:
                    return None, None
                self.reconnects += 1  # the server had closed the kept connection: once more on a new one
                continue
            except (OSError, http.client.HTTPException):
                self.close()
                return None, None
            if resp.will_close or not self.reuse:
                self.close()
            if resp.status != 200:
                return resp.status, None
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return None, None
        return None, None


def answering_endpoint(server: str, url: str, key_file: Path, text: str, timeout: float) -> Endpoint:
    """The endpoint once one valid review gets its label. A server may still be starting (`make serve-mlflow` in
    the background; a TorchServe started without `make serve`, which waits, answers 400 until its worker has
    written the key file): a valid request is sent once a second, the key file read again each time, until
    `timeout`. SystemExit with the last answer otherwise, so a sweep never measures a server that refuses every
    request."""
    from serving.client import inference_key

    deadline = time.monotonic() + timeout
    while True:
        endpoint = Endpoint(server, url, inference_key(key_file) if server == "torchserve" else None)
        connection = Connection(endpoint, reuse=False, timeout=30.0)
        status, answer = connection.post(endpoint.body(text), "application/json")
        connection.close()
        if status == 200 and endpoint.answered(answer):
            return endpoint
        if time.monotonic() >= deadline:
            last = f"HTTP {status}" if status is not None else "no answer (nothing listening?)"
            raise SystemExit(f"{server} at {url} did not answer a valid review within {timeout:.0f} s (last: {last});"
                             f" is it started (`make serve` / `make serve-mlflow`) and is {key_file} its key file?")
        time.sleep(1.0)
