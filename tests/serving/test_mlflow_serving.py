"""The maintained serving path: MLflow's scoring server for `models:/imdb-sentiment@champion` behind the contract
(the session's `champion`, tests/serving/conftest.py, `python -m serving.mlflow_server` on a free loopback port) on
a tiny-model variant that the evaluate and package stages logged, registered and aliased in a SQLite store. It
must answer like `SentimentPredictor` (what TorchServe's handler runs) on the same variant directory, and serve
the version the `.mar`'s `serving.json` names, and cut slow clients at the timeouts it was started with. What both
servers must answer alike is in test_conformance.py."""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from pipeline.deployment.inference import SentimentPredictor
from tests.factories import SERVING_LIMITS, read_until_closed

BIN = Path(sys.executable).parent
REVIEWS = ["A wonderful, moving film; the cast is superb.", "Awful. Boring, predictable and far too long.",
           "It was fine.", "great " * 200]


def _post(url: str, payload: object) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_scoring_server_answers_like_the_predictor_on_the_same_variant(champion):
    expected = SentimentPredictor(champion["variant_dir"])
    want = expected.predict(REVIEWS)
    for payload in ({"dataframe_records": [{"text": t} for t in REVIEWS]}, {"inputs": REVIEWS},
                    {"dataframe_split": {"columns": ["text"], "data": [[t] for t in REVIEWS]}}):
        status, body = _post(champion["url"], payload)
        assert status == 200, body
        got = body["predictions"]
        assert [p["label"] for p in got] == [p.label for p in want], payload.keys()
        assert [p["score"] for p in got] == pytest.approx([p.score for p in want], abs=1e-6)


def test_this_projects_pyfunc_is_scored_through_its_predictor_with_pyfunc_predicts_answers(champion, monkeypatch):
    """`served_model`'s scorer skips MLflow's DataFrames for a model this project logged, calling the predictor its
    `predict` calls: the records equal `PyFuncModel.predict`'s, and `PyFuncModel.predict` is not called."""
    import mlflow
    import pandas as pd
    from mlflow.pyfunc import PyFuncModel

    from pipeline.deployment.mlflow_model import local_model, served_model

    served = served_model("models:/imdb-sentiment@champion", tracking_uri=champion["store"])
    assert served.variant == "fp32-onnx"
    texts = [*REVIEWS, "NA"]  # "NA": what pandas would read back from CSV as missing
    calls: list[int] = []
    real = PyFuncModel.predict
    monkeypatch.setattr(PyFuncModel, "predict", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    direct = served.score(texts)
    assert calls == []
    through_mlflow = mlflow.pyfunc.load_model(local_model("models:/imdb-sentiment@champion",
                                                          tracking_uri=champion["store"]))
    want = through_mlflow.predict(pd.DataFrame({"text": texts})).to_dict(orient="records")
    assert calls == [1] and direct == want


def test_scoring_server_refuses_input_without_the_text_column(champion):
    status, body = _post(champion["url"], {"dataframe_records": [{"review": "no text column"}]})
    assert status == 400 and "text" in json.dumps(body)


def test_the_archive_names_the_version_the_alias_serves(champion):
    import mlflow

    with zipfile.ZipFile(champion["mar"]) as archive:
        served = json.loads(archive.read("serving.json"))["registered_model"]
    version = mlflow.MlflowClient(tracking_uri=champion["store"]).get_model_version_by_alias("imdb-sentiment",
                                                                                              "champion")
    assert served["uri"] == "models:/imdb-sentiment@champion" and served["version"] == str(version.version)
    assert version.source == f"models:/{served['model_id']}"
    assert champion["manifest"]["model"] == f"imdb-sentiment:v{version.version}/fp32-onnx"


def test_building_the_app_reads_the_store_from_params_and_writes_no_environment(champion, tmp_path, monkeypatch):
    """`build_app` hands the params' store to the registry lookups and the model's download itself: MLflow's
    process-wide tracking URI (pointed at another, empty store here) is neither read nor changed, and the
    environment is left as it was but for the one flag MLflow's own scoring app sets for its process
    (`_MLFLOW_IS_IN_SERVING_ENVIRONMENT`, `mlflow.pyfunc.scoring_server.init`)."""
    import os

    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    from serving.mlflow_server import build_app

    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setattr(tracking_utils, "_tracking_uri", elsewhere)  # restored after the test, env untouched
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "false")  # so that the flag is removed again after
    before = dict(os.environ)
    app = build_app(None, champion["params"])
    after = dict(os.environ)
    changed = {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed == {"_MLFLOW_IS_IN_SERVING_ENVIRONMENT": "true"}
    assert mlflow.get_tracking_uri() == elsewhere and not (tmp_path / "elsewhere.db").exists()
    assert (app.version, app.variant) == (champion["manifest"]["registered_model"]["version"], "fp32-onnx")


def test_the_app_loads_the_version_it_resolved_the_alias_to(champion, monkeypatch):
    """The alias is resolved once: the model loaded is that version (`models:/<name>/<version>`), so an alias
    moved between the lookup and the download cannot serve one version under another's number."""
    import serving.mlflow_server as server
    from pipeline.deployment import mlflow_model

    loaded = []
    real = mlflow_model.served_model
    monkeypatch.setattr(mlflow_model, "served_model", lambda uri, **kw: (loaded.append(uri), real(uri, **kw))[1])
    app = server.build_app(None, champion["params"])
    assert loaded == [f"models:/imdb-sentiment/{app.version}"]


def test_a_version_uri_serves_that_version_and_any_other_model_is_unregistered_with_params_limits(champion,
                                                                                                    tmp_path):
    """`--model-uri models:/<name>/<version>` answers as that version (its number on every answer, the limits its
    package run recorded); a model outside the registry (its folder) is "unregistered" and enforces params' limits,
    having no package run to read them from."""
    import mlflow

    from pipeline.core.params import PackageParams
    from pipeline.deployment.protocol import Limits
    from serving.mlflow_server import build_app

    version = champion["manifest"]["registered_model"]["version"]
    with zipfile.ZipFile(champion["mar"]) as archive:
        packaged = Limits.from_config(json.loads(archive.read("serving.json")))
    edited = tmp_path / "params.yaml"
    edited.write_text(yaml.safe_dump({"mlflow": {"tracking_uri": champion["store"]},
                                      "package": {**SERVING_LIMITS, "max_texts": SERVING_LIMITS["max_texts"] + 3}}))
    by_number = build_app(f"models:/imdb-sentiment/{version}", edited)
    assert (by_number.version, by_number.variant, by_number.limits) == (version, "fp32-onnx", packaged)
    folder = mlflow.artifacts.download_artifacts(f"models:/imdb-sentiment/{version}", tracking_uri=champion["store"],
                                                 dst_path=str(tmp_path / "model"))
    outside = build_app(folder, edited)
    assert outside.version == "unregistered"
    assert outside.limits == Limits.from_config(vars(PackageParams(**{**SERVING_LIMITS,
                                                                     "max_texts": SERVING_LIMITS["max_texts"] + 3})))


def _get(url: str | urllib.request.Request) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of sample `name{labels}` in Prometheus text, 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(part.split("=", 1) for part in line[line.find("{") + 1 : line.rfind("}")].split(",")
                         if "=" in part)
            if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_readiness_metrics_and_logs_for_operators(champion):
    status, headers, body = _get(f"{champion['url']}/ready")
    version = champion["manifest"]["registered_model"]["version"]
    assert status == 200 and json.loads(body) == {"status": "ready", "version": version, "variant": "fp32-onnx"}
    assert headers["x-model-version"] == version and headers["x-model-variant"] == "fp32-onnx"
    before = _get(f"{champion['url']}/metrics")[2].decode()
    assert _post(champion["url"], {"inputs": ["fine", "awful"]})[0] == 200
    assert _post(champion["url"], {"inputs": [None]})[0] == 400
    status, headers, body = _get(f"{champion['url']}/metrics")
    after = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name, labels, delta in (
        ("sentiment_requests_total", {"path": "/invocations", "method": "POST", "status": "200"}, 1),
        ("sentiment_requests_total", {"path": "/invocations", "method": "POST", "status": "400"}, 1),
        ("sentiment_request_errors_total", {"kind": "invalid_input", "side": "client"}, 1),
        ("sentiment_texts_scored_total", {}, 2),
        ("sentiment_request_latency_seconds_count", {"path": "/invocations"}, 2),
    ):
        assert _metric(after, name, **labels) - _metric(before, name, **labels) == delta, (name, labels)
    assert _metric(after, "sentiment_model_info", version=version, variant="fp32-onnx") == 1
    forged = urllib.request.Request(f"{champion['url']}/no-such-path", headers={"X-Forwarded-For": "203.0.113.9"})
    assert _get(forged)[0] == 404
    log = (champion["log_dir"] / "mlflow_server.log").read_text()
    assert '"POST /invocations HTTP/1.1" 400' in log and "serving models:/imdb-sentiment@champion" in log
    # the access log names the socket's peer, not what a client wrote in X-Forwarded-For
    assert '127.0.0.1:' in log and "203.0.113.9" not in log


def test_slow_clients_are_cut_at_the_servers_timeouts(champion):
    """`--header-timeout` and `--body-timeout` reach the running server: headers begun and never finished get a 408
    and a closed connection (`serving.request_deadline`), and so does a body that stalls (the middleware's JSON 408,
    with the request id), each within the timeout it was started with."""
    host, port = champion["url"].removeprefix("http://").split(":")
    limit = champion["timeouts_s"]
    with socket.create_connection((host, int(port)), timeout=limit + 10) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: test\r\n")
        data, waited = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and limit * 0.8 <= waited < limit + 5, (data[:200], waited)
    with socket.create_connection((host, int(port)), timeout=limit + 10) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nX-Request-Id: slow-body-1\r\n\r\n{\"inputs\": [\"fi")
        data, waited = read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), data[:300]
    assert json.loads(body) == {"error": f"the request body did not arrive within {limit:g} s (15 bytes received)",
                                "status": 408, "request_id": "slow-body-1"}
    assert limit * 0.8 <= waited < limit + 5


def _raw(url: str, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send `request` as it is on a fresh connection (headers http.client would not send twice, a target it would
    not write) and read the answer to the end: its status line, headers and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data, _ = read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, {k.decode().lower(): v.decode().strip() for k, _, v in (x.partition(b":") for x in lines)}, body


def test_requests_the_contract_cannot_read_one_way_are_refused_before_scoring(champion):
    """Two Content-Types (a proxy may read the first, this server the last: the body checked as one thing and scored
    as another), an expectation other than 100-continue, a target that is no path, and bytes that are no request
    are each refused with the contract's JSON error and its request id, the connection closed; `/metrics` counts
    the last one too, although no request reached the app."""
    url = champion["url"]
    before = _get(f"{url}/metrics")[2].decode()
    body = b"text\nawful boring film\n"
    cases = [
        (b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Type: text/csv\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(body), body), b"400", "Content-Type sent more than once"),
        (b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Encoding: br\r\n"
         b"Content-Encoding: identity\r\nContent-Length: 2\r\n\r\n{}", b"400", "Content-Encoding sent more"),
        (b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nExpect: 200-ok\r\n"
         b"Content-Length: 2\r\n\r\n{}", b"417", "100-continue"),
        (b"POST %2Finvocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n"
         b'{"inputs": ["fine"]}', b"400", "must be a path"),
        (b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Length: 1x\r\n\r\n", b"400", "malformed HTTP request"),
    ]
    for request, status, needle in cases:
        line, headers, answer = _raw(url, request)
        error = json.loads(answer)
        assert line.split(b" ")[1] == status and needle in error["error"], (request[:60], line, error)
        assert headers["x-request-id"] == error["request_id"] and headers["connection"] == "close"
        assert headers["x-model-variant"] == "fp32-onnx"
    after = _get(f"{url}/metrics")[2].decode()
    labels = {"kind": "malformed_http", "side": "client"}
    assert _metric(after, "sentiment_request_errors_total", **labels) - \
        _metric(before, "sentiment_request_errors_total", **labels) == 1


def test_an_absolute_form_target_is_read_as_its_path(champion):
    """`POST http://host/invocations` (a client through a forward proxy; RFC 9112 3.2.2: a server must accept it) is
    scored as `POST /invocations` is, as nginx and TorchServe read it; its authority names nothing else here."""
    body = b'{"inputs": ["a wonderful film"]}'
    for target in (b"http://127.0.0.1/invocations", b"HTTP://elsewhere.example:9/invocations?x=1"):
        line, headers, answer = _raw(champion["url"], b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/"
                                     b"json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                     % (target, len(body), body))
        assert line.split(b" ")[1] == b"200" and json.loads(answer)["predictions"], (target, line, answer)
        assert headers["x-model-variant"] == "fp32-onnx" and headers["x-request-id"]
    line, _, answer = _raw(champion["url"], b"GET http://127.0.0.1/elsewhere HTTP/1.1\r\nHost: t\r\n"
                           b"Connection: close\r\n\r\n")
    assert line.split(b" ")[1] == b"404" and json.loads(answer)["status"] == 404


def test_head_is_answered_wherever_get_is(champion):
    """HEAD gets what GET would, headers only (RFC 9110: a server that answers GET answers HEAD); `Allow` says so
    where neither is the method."""
    for path in ("/ping", "/health", "/version", "/ready"):
        line, headers, answer = _raw(champion["url"], f"HEAD {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                                                      "\r\n".encode())
        assert line.startswith(b"HTTP/1.1 200 ") and answer == b"", (path, line, answer)
        assert headers["x-model-variant"] == "fp32-onnx" and headers["x-request-id"]
    line, headers, _ = _raw(champion["url"], b"PUT /ping HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n"
                                             b"Connection: close\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 405 ") and headers["allow"] == "GET, HEAD"


def test_every_get_answer_is_what_its_content_type_says(champion):
    """MLflow's app labels `/ping`'s "\\n" and `/version`'s bare version string `application/json`: a client that
    trusts the label failed to parse them. They go out as plain text now; what is JSON stays labelled JSON."""
    import mlflow

    for path in ("/ping", "/health", "/version", "/ready", "/metrics"):
        line, headers, answer = _raw(champion["url"], f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                                                      "\r\n".encode())
        assert line.startswith(b"HTTP/1.1 200 "), (path, line)
        if headers["content-type"].startswith("application/json"):
            json.loads(answer)
        else:
            assert headers["content-type"].startswith("text/plain"), (path, headers["content-type"])
    _, headers, answer = _raw(champion["url"], b"GET /version HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert answer.decode() == mlflow.__version__ and headers["content-type"] == "text/plain; charset=utf-8"


def test_the_launchers_log_appends_across_restarts_and_rotates(tmp_path):
    import logging
    import logging.config

    from serving.mlflow_server import log_config

    for start in range(2):  # two "runs" of the server
        logging.config.dictConfig(log_config(tmp_path, max_bytes=2000, backups=2))
        for i in range(15):
            logging.getLogger("serving.mlflow_server").warning("start %d line %d %s", start, i, "x" * 100)
        for handler in logging.getLogger("serving").handlers:
            handler.close()
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["mlflow_server.log", "mlflow_server.log.1", "mlflow_server.log.2"]
    text = "".join((tmp_path / name).read_text() for name in files)
    assert "start 1 line 14" in text and "start 0 line 9" in text  # the first run survived the second's start


def test_mlflow_models_predict_scores_a_csv_larger_than_any_request(champion, imdb_dir, tmp_path):
    """The README's batch command, as written there, on 300 real reviews (more than a request may hold): the
    registered champion scores them all with its own copy of the code (run outside the checkout), each row as the
    predictor scores it alone, in input order."""
    import os
    import subprocess

    import pandas as pd

    reviews = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"]).sample(n=300, random_state=5)
    csv = tmp_path / "reviews.csv"
    reviews.to_csv(csv, index=False)
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")},
           "MLFLOW_TRACKING_URI": champion["store"], "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "mlflow"), "models", "predict", "-m", "models:/imdb-sentiment@champion", "-i", str(csv),
           "-t", "csv", "-o", str(tmp_path / "scored.json"), "--env-manager", "local"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "scored.json").read_text())["predictions"]
    assert len(got) == 300
    predictor = SentimentPredictor(champion["variant_dir"], max_chars=champion["manifest"]["max_chars_per_text"])
    alone = [predictor.predict([t])[0] for t in reviews["text"]]
    assert [g["label"] for g in got] == [p.label for p in alone]
    assert max(abs(g["score"] - p.score) for g, p in zip(got, alone, strict=True)) <= 1e-4


def test_the_server_enforces_the_limits_the_served_version_was_packaged_with(champion, tmp_path, caplog):
    """The same registered version answers alike on both servers: the MLflow server takes its request limits from the
    version's package run (what the version's `.mar` holds in serving.json), not from a params file edited since
    (it warns that they differ); `--limits params` enforces params'."""
    import logging

    from pipeline.deployment.protocol import Limits
    from serving.mlflow_server import build_app

    with zipfile.ZipFile(champion["mar"]) as archive:
        packaged = Limits.from_config(json.loads(archive.read("serving.json")))
    edited = tmp_path / "params.yaml"
    edited.write_text(yaml.safe_dump({"mlflow": {"tracking_uri": champion["store"]},
                                      "package": {**SERVING_LIMITS, "max_texts": SERVING_LIMITS["max_texts"] + 3}}))
    with caplog.at_level(logging.WARNING, logger="serving"):
        app = build_app(None, edited)
    assert app.limits == packaged and app.limits.max_texts == SERVING_LIMITS["max_texts"]
    assert any("differ from params" in r.getMessage() for r in caplog.records)
    assert build_app(None, edited, limits_from="params").limits.max_texts == SERVING_LIMITS["max_texts"] + 3
