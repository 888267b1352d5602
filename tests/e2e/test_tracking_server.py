"""Beyond one machine: a team's tracking server as docs/mlflow.md stands it up (a PostgreSQL database created
with the page's `psql` command, `mlflow server` on it with a separate artifact destination, a free loopback port),
and the pipeline's stages pointed at it by `MLFLOW_TRACKING_URI` alone, with params left as they are: the runs, the
variants' models, the registered version and its `@champion` alias all land on the server (in PostgreSQL's tables,
the model files in the artifact store), nothing in the working directory's default store, and the champion loads
back through the server.

PostgreSQL replaced the SQLite backend this test used to run on: the server's code is the same SQLAlchemy store for
both, a local run's SQLite store is checked by every e2e run (tests/e2e/test_repro.py), and a second pass of the
same stages would double the module's time. Where PostgreSQL is not installed the module is skipped with that reason
(the test does not install it: `apt-get install postgresql` on Debian)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.core.params import Params
from pipeline.deployment.inference import SentimentPredictor
from serving.local_servers import free_port, start_server, stop_server
from tests.factories import ROOT, evaluated_fp32_onnx
from tests.postgres import postgres_bin_dir, postgres_cluster

BIN = Path(sys.executable).parent
DOCS = ROOT / "docs" / "mlflow.md"
#: The database as docs/mlflow.md creates it (run there as PostgreSQL's superuser: `sudo -u postgres psql ...`);
#: the test runs the same command against its own cluster.
CREATE_DATABASE = 'psql -c "CREATE USER mlflow PASSWORD \'change-me\'" -c "CREATE DATABASE mlflow OWNER mlflow"'
#: The server's environment as docs/mlflow.md sets it: MLflow's server-side jobs off (the pipeline uses none; on a
#: database backend they cost six job-runner processes).
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
#: The server's backend store as docs/mlflow.md names it, the database's host and port left to fill in.
BACKEND_STORE = "postgresql://mlflow:change-me@{host}:{port}/mlflow"


@pytest.fixture(scope="module")
def database():
    """A PostgreSQL cluster of its own with the `mlflow` database docs/mlflow.md creates; removed even when a test
    fails. Skipped, with the reason, where PostgreSQL's programs are not installed."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): the team "
                    "tracking server's test needs it; on Debian `apt-get install postgresql`")
    with postgres_cluster(bin_dir) as cluster:
        argv = shlex.split(CREATE_DATABASE)
        create = subprocess.run([str(bin_dir / argv[0]), "--host", str(cluster["socket_dir"]), "--port",
                                 str(cluster["port"]), "--username", cluster["superuser"], *argv[1:]],
                                capture_output=True, text=True, timeout=60)
        assert create.returncode == 0, create.stderr
        yield {**cluster, "uri": BACKEND_STORE.format(host=cluster["host"], port=cluster["port"])}


@pytest.fixture(scope="module")
def server(database, tmp_path_factory):
    """`mlflow server` on the PostgreSQL database with its own artifact directory; stopped even when a test fails."""
    root = tmp_path_factory.mktemp("tracking-server")
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PATH": f"{BIN}:{os.environ['PATH']}",
           **SERVER_ENV}
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", database["uri"],
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    proc = start_server(cmd, env, root, f"http://127.0.0.1:{port}/health", root / "server.log")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "root": root, "database": database}
    finally:
        stop_server(proc)


def test_the_docs_stand_the_server_up_as_this_test_does():
    """docs/mlflow.md shows the commands this module runs: the same database command and a server on PostgreSQL
    with a separate artifact destination, and the pipeline pointed at it by `MLFLOW_TRACKING_URI`."""
    page = DOCS.read_text(encoding="utf-8")
    assert f"sudo -u postgres {CREATE_DATABASE}" in page
    shown = BACKEND_STORE.format(host="db.example.org", port=5432)
    env = " ".join(f"{k}={v}" for k, v in SERVER_ENV.items())
    command = next(line for line in page.replace("\\\n    ", "").splitlines() if ".venv/bin/mlflow server" in line)
    assert command.startswith(f"{env} .venv/bin/mlflow server --backend-store-uri {shown} --artifacts-destination")
    # one worker, as this module's server runs: uvicorn's multi-worker mode costs every keep-alive call a delayed
    # ACK (benchmarks.tracking_load, docs/past-one-machine.md)
    assert command.split()[-2:] == ["--workers", "1"], command
    assert "MLFLOW_TRACKING_URI=http://" in page and "make run" in page


def table(database: dict, query: str) -> list[tuple]:
    """Rows of `query` read from the tracking server's database directly (as its `mlflow` role, over TCP)."""
    import psycopg

    with psycopg.connect(database["uri"]) as connection:
        return connection.execute(query).fetchall()


def test_stages_run_unchanged_against_a_tracking_server(server, tiny_model_dir, built, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    monkeypatch.setenv("PIPELINE_RUN_ID", "remote-test")
    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")  # the default profile, untouched
    params = Params()
    assert params.mlflow.tracking_uri == "sqlite:///mlflow.db"
    # the evaluate stage's MLflow work, in this process
    dirs = evaluated_fp32_onnx(tmp_path, tiny_model_dir, params, built["dirs"]["fp32-onnx"])
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
    # what the server said it stored is in PostgreSQL's tables (the backend store), not in a file beside it
    database = server["database"]
    assert len(table(database, "SELECT run_uuid FROM runs WHERE status = 'FINISHED'")) == len(runs)
    assert sorted(name for (name,) in table(database, "SELECT name FROM logged_models")) == ["fp32-eager", "fp32-onnx"]
    assert table(database, "SELECT name, alias, version FROM registered_model_aliases") == [
        ("imdb-sentiment", "champion", int(version.version))]
    assert not list(server["root"].rglob("*.db")) and not list(server["root"].rglob("*.sqlite"))
