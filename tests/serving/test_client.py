"""`serving.client` and `serving.health` against a stand-in for TorchServe's token authorization on loopback:
an expired inference key is replaced through the token API (`/token?type=inference` with the API key, which
writes the new key to the key file) and the request retried once. The real server's side of this is in
test_torchserve.py (a key replaced through the token API, /ping refused without a key)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving.client import inference_key, predict
from serving.health import probe, wait_until_healthy

INVALID = {"code": 400, "type": "InvalidKeyException",
           "message": "Token Authorization failed. Token either incorrect, expired, or not provided correctly"}


class FakeTorchServe:
    """Inference and management APIs on one loopback port, with TorchServe's key file and token API."""

    def __init__(self, key_file: Path) -> None:
        self.key_file, self.api_key, self.generation = key_file, "api-key", 0
        self.refreshes, self.refresh_works = 0, True
        self.ping_body: bytes | None = None  # what /ping answers instead of its JSON, when set
        self.valid_key = self.write_keys()

    def write_keys(self) -> str:
        self.generation += 1
        key = f"inference-{self.generation}"
        self.key_file.write_text(json.dumps({"inference": {"key": key}, "management": {"key": "m"},
                                             "API": {"key": self.api_key}}))
        return key

    def answer(self, path: str, auth: str | None) -> tuple[int, object]:
        if path.startswith("/token"):
            if auth != f"Bearer {self.api_key}" or not self.refresh_works:
                return 400, INVALID
            self.refreshes += 1
            self.valid_key = self.write_keys()
            return 200, None
        if auth != f"Bearer {self.valid_key}":
            return 400, INVALID
        if path == "/ping":
            return 200, self.ping_body or {"status": "Healthy"}
        return 200, {"label": "positive", "score": 0.9, "model": "m"}


@pytest.fixture
def fake(tmp_path) -> Iterator[tuple[FakeTorchServe, str]]:
    state = FakeTorchServe(tmp_path / "key_file.json")

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = state.answer(self.path, self.headers.get("Authorization"))
            data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _reply

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_expired_key_is_replaced_through_the_token_api_and_the_request_retried(fake):
    state, url = fake
    expired = inference_key(state.key_file)
    state.valid_key = "after-expiry"  # the server no longer accepts the key the file still holds
    assert predict(["x"], url, expired, key_file=state.key_file)[0] == 400  # without the token API: refused
    status, body = predict(["x"], url, expired, key_file=state.key_file, management_url=url)
    assert status == 200 and body["label"] == "positive"
    assert state.refreshes == 1 and inference_key(state.key_file) == state.valid_key


def test_a_key_replaced_by_someone_else_is_read_from_the_file_without_a_new_one(fake):
    state, url = fake
    old = inference_key(state.key_file)
    state.valid_key = state.write_keys()
    status, _ = predict(["x"], url, old, key_file=state.key_file, management_url=url)
    assert status == 200 and state.refreshes == 0


def test_the_retry_happens_once_and_other_errors_are_not_retried(fake):
    state, url = fake
    state.valid_key, state.refresh_works = "unreachable", False
    status, body = predict(["x"], url, inference_key(state.key_file), key_file=state.key_file, management_url=url)
    assert status == 400 and body["type"] == "InvalidKeyException"


def test_health_probe_refreshes_an_expired_key(fake):
    state, url = fake
    state.valid_key = "after-expiry"
    assert probe(url, state.key_file, None, predict=True, timeout=5) == (
        False, f"/ping answered 400: {INVALID}")
    healthy, seen = probe(url, state.key_file, url, predict=True, timeout=5)
    assert healthy and seen == "/ping: Healthy; prediction: positive"
    assert state.refreshes == 1


def test_a_key_file_being_written_is_waited_for_not_mistaken_for_keys(tmp_path, monkeypatch):
    """TorchServe creates `key_file.json` before it writes it: a reader that finds it empty or cut off waits for
    the writer instead of failing; one that stays unreadable is a clear error, and no file means no token auth.
    The writer's steps happen while the reader waits (its `sleep`), so the test runs the same way on any machine."""
    import time
    import types

    import serving.client
    from serving.client import KeyFileError

    key_file = tmp_path / "key_file.json"
    assert inference_key(key_file) is None
    key_file.write_text("")
    complete = json.dumps({"management": {"key": "m"}, "inference": {"key": "fresh"}, "API": {"key": "a"}})
    steps = [complete[:20], complete]  # a half-written file on the way, then the whole one
    waits: list[str] = []

    def writer_step(_seconds: float) -> None:
        waits.append(key_file.read_text())  # what the reader had just found incomplete
        key_file.write_text(steps.pop(0))

    monkeypatch.setattr(serving.client, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=writer_step))
    assert inference_key(key_file) == "fresh"
    assert waits == ["", complete[:20]]  # it waited out the empty and the cut-off file
    monkeypatch.setattr(serving.client, "time", time)  # the real clock for the settle timeouts below
    from serving.client import read_key_file

    for broken in ("{\"inference\": ", "[1, 2]", "{\"API\": {\"key\": \"a\"}}"):
        key_file.write_text(broken)
        with pytest.raises(KeyFileError, match=r"key_file\.json"):
            read_key_file(key_file, settle_s=0.2)


def test_health_wait_probes_until_the_server_answers(fake):
    """`--wait` (what `make serve` waits with): probes once a second while the server refuses, and stops at the
    first healthy answer."""
    state, url = fake
    ready_key, state.valid_key = state.valid_key, "not-yet"  # the worker is still loading: every call is refused
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            state.valid_key = ready_key  # ready after the second wait

    assert wait_until_healthy(url, state.key_file, None, predict=True, timeout=5, wait=60, sleep=sleep) == (
        True, "/ping: Healthy; prediction: positive")
    assert sleeps == [1.0, 1.0]


def test_health_wait_gives_up_at_its_deadline_and_says_what_it_saw_last(fake, tmp_path):
    state, url = fake
    state.valid_key = "never"
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    assert wait_until_healthy(url, state.key_file, None, predict=True, timeout=5, wait=3, clock=lambda: now[0],
                              sleep=sleep) == (False, f"/ping answered 400: {INVALID}")
    assert sleeps == [1.0, 1.0, 1.0]
    half_written = tmp_path / "half.json"
    half_written.write_text('{"inference": ')  # a key file TorchServe is still writing, for longer than it settles
    healthy, seen = wait_until_healthy(url, half_written, None, predict=False, timeout=5, wait=0)
    assert not healthy and seen.startswith("key file not readable yet")



def test_the_probe_answers_one_line_whatever_the_server_or_key_file_holds(fake, monkeypatch):
    """`serving.health`'s contract (one line, exit 1) holds for an answer that is neither JSON nor UTF-8, a key
    file cut off while a refused key is refreshed, and a key file whose API key is not a string."""
    import serving.client
    from serving.client import read_key_file, request

    state, url = fake
    state.ping_body = b"<html>\xe9\xff</html>"
    assert request("GET", f"{url}/ping", key=state.valid_key) == (200, "<html>\ufffd\ufffd</html>")
    healthy, seen = probe(url, state.key_file, url, predict=False, timeout=5)
    assert not healthy and seen.startswith("/ping answered 200: <html>")
    state.ping_body = None

    key, whole = state.valid_key, state.key_file.read_text()
    state.valid_key = "rotated"  # the probe's key is refused, so the refresh reads the key file again: cut off
    reads: list[Path] = []

    def read_then_cut_off(key_file: Path, settle_s: float = 2.0) -> dict | None:
        reads.append(key_file)
        if len(reads) > 1:
            key_file.write_text(whole[:10])
        return read_key_file(key_file, settle_s=0.1)

    monkeypatch.setattr(serving.client, "read_key_file", read_then_cut_off)
    healthy, seen = probe(url, state.key_file, url, predict=False, timeout=5)
    assert not healthy and seen.startswith("/ping unreachable:") and "not complete JSON" in seen, seen
    assert len(reads) == 2
    monkeypatch.undo()

    state.key_file.write_text(json.dumps({"inference": {"key": key}, "API": {"key": 5}}))
    healthy, seen = probe(url, state.key_file, url, predict=False, timeout=5)  # no usable API key: no refresh
    assert not healthy and seen == f"/ping answered 400: {INVALID}" and state.refreshes == 0
