"""Unit: the serving soak's malformed mix, target check and client connections (against a stand-in HTTP server on
loopback; the load itself needs a running model server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.load_clients import Connection, Endpoint, answering_endpoint, malformed_bodies
from benchmarks.serve_load import table, targets, torchserve_batching, valid_rate
from pipeline.deployment.protocol import RequestError
from pipeline.deployment.request_parsing import parse_request
from serving.local_servers import free_port
from tests import factories


def test_every_kind_of_malformed_request_is_refused_by_the_protocol():
    limits = factories.limits(max_texts=4, max_body_bytes=2048)
    kinds = malformed_bodies(limits.max_body_bytes, limits.max_texts)
    assert len({kind for kind, _, _ in kinds}) == len(kinds) >= 8
    for _, body, content_type in kinds:
        with pytest.raises(RequestError):
            parse_request(body, limits, content_type)


def test_the_mlflow_poison_is_the_same_kinds_in_mlflows_request_format():
    ts = dict((kind, body) for kind, body, _ in malformed_bodies(2048, 4))
    ml = dict((kind, body) for kind, body, _ in malformed_bodies(2048, 4, "mlflow"))
    assert ts.keys() == ml.keys()
    assert ml["not-a-string"] == b'{"dataframe_records": [{"text": 42}]}'
    assert len(json.loads(ml["too-many-texts"])["dataframe_records"]) == 5
    assert len(ml["oversized"]) > 2048


def test_an_answer_counts_only_with_a_label_for_the_one_review_sent():
    mlflow, ts = Endpoint("mlflow", "http://127.0.0.1:5001"), Endpoint("torchserve", "http://127.0.0.1:8080")
    assert json.loads(mlflow.body("good")) == {"dataframe_records": [{"text": "good"}]}
    assert mlflow.path == "/invocations" and ts.path == "/predictions/sentiment"
    assert mlflow.answered({"predictions": [{"label": "positive", "score": 0.9}]})
    assert not mlflow.answered({"predictions": []}) and not mlflow.answered({"label": "positive"})
    assert ts.answered({"label": "positive", "score": 0.9}) and not ts.answered({"error": "x"})


def test_the_recorded_batching_is_the_config_torchserve_starts_with():
    settings = torchserve_batching()
    assert {"batchSize", "maxBatchDelay", "minWorkers", "maxWorkers"} <= settings.keys()


def _row(concurrency, errors=0, ok_pct=100.0, p50=10.0, p99=20.0, ratio=0.9):
    return {"concurrency": concurrency, "valid_sent": 100, "valid_ok_pct": ok_pct, "valid_errors": errors,
            "malformed_4xx_pct": 100.0, "p50_ms": p50, "p99_ms": p99, "requests_per_s": 50.0,
            "valid_requests_per_s": 50.0, "in_process_per_s": 50.0 / ratio, "served_vs_in_process": ratio}


def test_targets_read_the_sweep():
    good = targets([_row(1), _row(8), _row(32)], 0.1)
    assert all(good.values())
    bad = targets([_row(1, errors=1, ok_pct=99.0, ratio=0.6), _row(8, p99=31.0, ratio=0.7)], 0.1)
    assert not any(bad.values())
    assert bad["served_at_least_0.8_of_in_process_at_32"] is None  # not in this sweep
    assert targets([_row(1, ratio=0.75)], 0.1)["served_at_least_0.8_of_in_process_at_1"] is False
    assert targets([_row(1, ratio=0.85)], 0.1)["served_at_least_0.8_of_in_process_at_1"] is True
    failed_warmup = {**_row(1), "warmup": {"seconds": 15.0, "requests": 300, "errors": 2}}
    assert targets([failed_warmup], 0.1)["zero_errors_on_valid"] is False  # an error while warming up counts too
    assert targets([_row(1)], 0.0)["p99_at_most_3x_p50_at_8"] is None
    assert targets([_row(8)], 0.0)["all_valid_answered_200_with_malformed_mixed_in"] is None
    assert "| 8 | 100 | 100.00 | 0 |" in table([_row(8)])


def test_the_ratio_counts_valid_answers_over_the_clients_time_on_valid_requests():
    # 4 clients for 10 s, 8 client-seconds of it waiting on malformed requests: 32 s on valid ones
    assert valid_rate(320, 4, 10.0, 8.0) == pytest.approx(40.0)  # not 320 / 10 = 32, the wall-time rate
    assert valid_rate(320, 4, 10.0, 0.0) == pytest.approx(32.0)  # no poison: the two rates agree
    assert valid_rate(0, 1, 1.0, 1.0) == 0.0


@pytest.fixture
def stand_in():
    """A loopback HTTP/1.1 server answering `{"label"}`, 400 for a body of `bad`, that counts the connections it
    accepted; `mode` says how it treats a kept connection after answering: keep it, announce `Connection: close`,
    or drop it without saying so (as a server's idle timeout does)."""
    state = {"connections": 0, "mode": "keep", "seen": []}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            state["connections"] += 1
            self.answered = 0

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.answered and state["mode"] == "drop":  # a kept connection the server had already closed
                self.close_connection = True
                return
            state["seen"].append((self.headers.get("Authorization"), self.headers.get("Connection")))
            reply, status = (b'{"error": "bad"}', 400) if body == b"bad" else (b'{"label": "positive"}', 200)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            if state["mode"] == "close":
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(reply)
            self.answered += 1

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield Endpoint("torchserve", f"http://127.0.0.1:{server.server_address[1]}", key="k"), state
    server.shutdown()
    server.server_close()


def test_a_client_keeps_one_connection_and_reads_every_answer(stand_in):
    endpoint, state = stand_in
    client = Connection(endpoint)
    answers = [client.post(b'{"text": "x"}', "application/json") for _ in range(5)]
    assert answers == [(200, {"label": "positive"})] * 5
    assert client.post(b"bad", "application/json") == (400, None)
    assert client.post(b'{"text": "x"}', "application/json") == (200, {"label": "positive"})
    assert state["connections"] == client.opened == 1 and client.reconnects == 0
    assert {auth for auth, _ in state["seen"]} == {"Bearer k"}


@pytest.mark.parametrize("mode", ["close", "drop"])
def test_a_connection_the_server_closes_is_reopened_without_losing_the_request(stand_in, mode):
    """Announced (`Connection: close`) or not (the kept connection is gone when the next request arrives): every
    request is still answered, on a new connection; only the silent close costs a second send."""
    endpoint, state = stand_in
    state["mode"] = mode
    client = Connection(endpoint)
    assert [client.post(b'{"text": "x"}', "application/json") for _ in range(4)] == [(200, {"label": "positive"})] * 4
    assert len(state["seen"]) == 4
    assert client.reconnects == (3 if mode == "drop" else 0)
    assert client.opened == state["connections"] == 4


def test_a_connection_per_request_when_asked(stand_in):
    endpoint, state = stand_in
    client = Connection(endpoint, reuse=False)
    for _ in range(3):
        assert client.post(b'{"text": "x"}', "application/json") == (200, {"label": "positive"})
    assert client.opened == state["connections"] == 3
    assert {conn for _, conn in state["seen"]} == {"close"}


def test_no_server_is_no_answer_not_a_crash():
    client = Connection(Endpoint("mlflow", "http://127.0.0.1:9"), timeout=2.0)
    assert client.post(b"{}", "application/json") == (None, None)


def test_a_sweep_waits_for_its_server_and_refuses_to_measure_one_that_never_answers(stand_in, tmp_path):
    """`answering_endpoint`: the key file read as the server writes it; a server that refuses every valid review
    (here: no server on the port) stops the sweep with what it answered, instead of a table of errors."""
    endpoint, state = stand_in
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({"inference": {"key": "fresh"}, "management": {"key": "m"}, "API": {"key": "a"}}))
    ready = answering_endpoint("torchserve", endpoint.url, key_file, "a fine film", timeout=5)
    assert ready.key == "fresh" and state["seen"][-1][0] == "Bearer fresh"
    with pytest.raises(SystemExit, match="did not answer a valid review within 0 s"):
        answering_endpoint("mlflow", f"http://127.0.0.1:{free_port()}", key_file, "a fine film", timeout=0)
