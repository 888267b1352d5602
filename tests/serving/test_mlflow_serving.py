"""The maintained serving path: MLflow's scoring server for `models:/imdb-sentiment@champion` behind the contract
(the session's `champion`, tests/serving/conftest.py, `python -m serving.mlflow_server` on a free loopback port) on
a tiny-model variant that the evaluate and package stages logged, registered and aliased in a SQLite store. It
must answer like `SentimentPredictor` (what TorchServe's handler runs) on the same variant directory, and serve
the version the `.mar`'s `serving.json` names. What both servers must answer alike is in test_conformance.py."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from pipeline.deployment.inference import SentimentPredictor

pytestmark = pytest.mark.slow
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
