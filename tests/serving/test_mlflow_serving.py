"""The maintained serving path: a real `mlflow models serve -m models:/imdb-sentiment@champion` (local env manager,
free loopback port) on a tiny-model variant that the evaluate and package stages logged, registered and aliased
in a SQLite store. It must answer like `SentimentPredictor` (what TorchServe's handler runs) on the same
variant directory, and serve the version the `.mar`'s `serving.json` names.

The server runs from a directory outside the checkout without PYTHONPATH: the model carries its own code."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from pipeline.core.params import MlflowParams, PackageParams, Params
from pipeline.deployment.inference import SentimentPredictor
from tests.factories import evaluated_fp32_onnx, free_port, start_server, stop_server

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REVIEWS = ["A wonderful, moving film; the cast is superb.", "Awful. Boring, predictable and far too long.",
           "It was fine.", "great " * 3000]  # the last is cut to package.max_chars_per_text like in TorchServe


@pytest.fixture(scope="module")
def champion(tmp_path_factory, tiny_model_dir):
    """The tiny model's fp32-onnx variant evaluated, packaged as `imdb-sentiment@champion`, and a scoring server
    for `models:/imdb-sentiment@champion` (stopped even when a test fails)."""
    from pipeline.deployment.archive import run_package_stage

    work = tmp_path_factory.mktemp("mlflow-serve")
    store = f"sqlite:///{work / 'mlflow.db'}"
    params = Params(mlflow=MlflowParams(tracking_uri=store))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("PIPELINE_RUN_ID", "serving-test")
        dirs = evaluated_fp32_onnx(work, tiny_model_dir, params)
        manifest = run_package_stage(work / "variants", work / "variants.json", work / "benchmark.json",
                                     work / "sentiment.mar", work / "package.json", params)
    port = free_port()
    serve_dir = work / "elsewhere"
    serve_dir.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "MLFLOW_TRACKING_URI": store,
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # `mlflow models serve` starts `uvicorn` from PATH
    cmd = [str(BIN / "mlflow"), "models", "serve", "-m", "models:/imdb-sentiment@champion", "--env-manager", "local",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    proc = start_server(cmd, env, serve_dir, f"http://127.0.0.1:{port}/ping", work / "serve.log")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "variant_dir": dirs["fp32-onnx"], "manifest": manifest,
               "mar": work / "sentiment.mar", "store": store}
    finally:
        stop_server(proc)


def _post(url: str, payload: object) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_scoring_server_answers_like_the_predictor_on_the_same_variant(champion):
    expected = SentimentPredictor(champion["variant_dir"], max_chars=PackageParams().max_chars_per_text)
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
