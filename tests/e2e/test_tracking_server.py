"""Beyond one machine: a real `mlflow server` (SQLite backend, local artifact destination, free loopback port)
and the pipeline's stages pointed at it by `MLFLOW_TRACKING_URI` alone, with params left as they are: the runs,
the variants' models, the registered version and its `@champion` alias all land on the server, nothing in the
working directory's default store, and the champion loads back through the server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.core.params import Params
from pipeline.deployment.inference import SentimentPredictor
from tests.factories import ROOT, evaluated_fp32_onnx, free_port, start_server, stop_server

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` with its own SQLite store and artifact directory; stopped even when a test fails."""
    root = tmp_path_factory.mktemp("tracking-server")
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    proc = start_server(cmd, env, root, f"http://127.0.0.1:{port}/health", root / "server.log")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "root": root}
    finally:
        stop_server(proc)


def test_stages_run_unchanged_against_a_tracking_server(server, tiny_model_dir, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    monkeypatch.setenv("PIPELINE_RUN_ID", "remote-test")
    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")  # the default profile, untouched
    params = Params()
    assert params.mlflow.tracking_uri == "sqlite:///mlflow.db"
    dirs = evaluated_fp32_onnx(tmp_path, tiny_model_dir, params)  # the evaluate stage's MLflow work, in this process
    # the package stage as `dvc repro` runs it: its own process, the environment naming the server
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "stages.package", "--params", "params.yaml", "--variants-metrics", "variants.json",
         "--benchmark", "benchmark.json", "--variants-dir", "variants", "--mar", "sentiment.mar",
         "--manifest", "package.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()

    client = mlflow.MlflowClient(tracking_uri=server["url"])
    experiment = client.get_experiment_by_name(params.mlflow.experiment)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id], "tags.`pipeline.run_id` = 'remote-test'")
    roles = sorted((r.data.tags["pipeline.role"], r.data.tags.get("pipeline.stage", ""), r.info.run_name)
                   for r in runs)
    assert roles == [("parent", "", "pipeline-remote-test"), ("stage", "evaluate", "fp32-eager"),
                     ("stage", "evaluate", "fp32-onnx"), ("stage", "package", "package")]
    parent = next(r for r in runs if r.data.tags["pipeline.role"] == "parent")
    assert parent.data.tags["served_variant"] == "fp32-onnx" and parent.data.metrics["served_p50_ms"] == 4.0
    models = {m.name: m for m in client.search_logged_models([experiment.experiment_id])}
    assert set(models) == {"fp32-eager", "fp32-onnx"}
    assert {m.key for m in models["fp32-onnx"].metrics} >= {"accuracy", "agreement_with_fp32", "size_mb"}
    assert models["fp32-onnx"].artifact_location.startswith("mlflow-artifacts:")  # stored by the server
    assert list((server["root"] / "artifacts").rglob("model.onnx"))
    version = client.get_model_version_by_alias("imdb-sentiment", "champion")
    assert version.source == f"models:/{models['fp32-onnx'].model_id}"
    texts = ["a great film", "a dreadful film"]
    got = mlflow.pyfunc.load_model("models:/imdb-sentiment@champion").predict(pd.DataFrame({"text": texts}))
    want = SentimentPredictor(dirs["fp32-onnx"]).predict(texts)
    assert got["label"].tolist() == [p.label for p in want]
    assert got["score"].tolist() == pytest.approx([p.score for p in want], abs=1e-6)
