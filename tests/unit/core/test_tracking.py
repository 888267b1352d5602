"""Unit: MLflow bookkeeping lives in `pipeline.core.tracking` and `pipeline.core.parent_run` (and the registry's
and served model's modules) alone, and in a real SQLite store: a tracked stage records what its work returns
(numbers as metrics, statuses and reasons as tags, files as artifacts); the environment's tracking URI wins over
params; the experiment opens as model training; a predictor model loads as pyfunc and answers like
`SentimentPredictor`, with metrics from several runs linked to it; registering adds versions while the alias moves;
the parent run carries the summary and a table; datasets carry digests."""

from __future__ import annotations

import ast
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from pipeline.core.model_registry import alias_version, set_alias
from pipeline.core.params import MlflowParams, Params
from pipeline.core.parent_run import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    log_parent_summary,
    log_parent_table,
    tracking_uri,
)
from pipeline.core.tracking import stage_run, tracked_stage
from tests.factories import ROOT

TRACKING = ROOT / "pipeline" / "core" / "tracking.py"
PARENT_RUN = ROOT / "pipeline" / "core" / "parent_run.py"
SERVED_MODEL = ROOT / "pipeline" / "deployment" / "mlflow_model.py"
MODEL_REGISTRY = ROOT / "pipeline" / "core" / "model_registry.py"


def _imports_mlflow(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] == "mlflow" or n.endswith("MLFlowLogger")]
    return found


def test_only_the_tracking_registry_and_served_model_modules_talk_to_mlflow():
    owners = (TRACKING, PARENT_RUN, MODEL_REGISTRY, SERVED_MODEL)
    files = [p for d in ("pipeline", "stages", "serving") for p in (ROOT / d).rglob("*.py") if p not in owners]
    assert files and all(_imports_mlflow(p) for p in owners)  # the scan does see an import where there is one
    offenders = [hit for p in files for hit in _imports_mlflow(p)]
    assert offenders == []


def test_tracked_stage_logs_params_metrics_tags_and_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-tracking")
    params = Params(mlflow=MlflowParams(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="unit"))
    report_file = tmp_path / "report.json"
    report_file.write_text("{}")
    report = {"tensorrt-fp16": {"status": "skipped", "reason": "no CUDA"}, "size": {"mb": 2.5}, "flag": True}
    tracked_stage(params, "probe", ("tensorrt",), lambda: report, artifacts=(report_file,))
    runs = mlflow.search_runs(experiment_names=["unit"], filter_string="tags.`pipeline.stage` = 'probe'",
                              output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics == {"size.mb": 2.5}  # booleans are not metrics
    assert run.data.tags["tensorrt-fp16.status"] == "skipped"
    assert run.data.tags["tensorrt-fp16.reason"] == "no CUDA"
    assert run.data.params["tensorrt.max_batch"] == str(params.tensorrt.max_batch)
    parent = run.data.tags["mlflow.parentRunId"]
    assert mlflow.get_run(parent).data.tags["pipeline.role"] == "parent"
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)]
    assert artifacts == ["report.json"]


def _store(tmp_path: Path, name: str = "mlflow.db") -> MlflowParams:
    return MlflowParams(tracking_uri=f"sqlite:///{tmp_path / name}", experiment="unit")


def test_the_environment_names_the_tracking_store_and_the_experiment_opens_as_model_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-env")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'from-env.db'}")
    params = _store(tmp_path, "from-params.db")
    assert tracking_uri(params) == f"sqlite:///{tmp_path / 'from-env.db'}"
    with stage_run(params, "probe") as run:
        run.log_metrics({"x": 1.0})
    assert not (tmp_path / "from-params.db").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'from-env.db'}")
    experiment = client.get_experiment_by_name("unit")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert client.get_run(run.run_id).data.metrics == {"x": 1.0}
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri(params) == params.tracking_uri


def test_a_predictor_model_loads_as_pyfunc_and_answers_like_the_predictor(tmp_path, monkeypatch, tiny_model_dir):
    from pipeline.deployment.inference import EXAMPLE_REVIEWS, SentimentPredictor, runtime_requirements
    from pipeline.deployment.mlflow_model import log_predictor_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-model")
    params = _store(tmp_path)
    with stage_run(params, "evaluate", run_name="fp32-eager") as run:
        ref = log_predictor_model(run, "fp32-eager", tiny_model_dir, SentimentPredictor, EXAMPLE_REVIEWS,
                                  {"max_chars": 64, "threads": 1}, runtime_requirements("eager"),
                                  params={"heads": 12}, tags={"variant": "fp32-eager"}, model_type="eager")
        run.log_metrics({"accuracy": 0.75, "note": "text is skipped"}, model_id=ref.model_id)
    with stage_run(params, "benchmark") as other:
        other.log_metrics({"p50_ms_b1": 4.5}, model_id=ref.model_id)
    assert ref.uri == f"models:/{ref.model_id}" and ref.files
    client = mlflow.MlflowClient()
    model = client.get_logged_model(ref.model_id)
    assert model.name == "fp32-eager" and model.source_run_id == run.run_id and model.model_type == "eager"
    assert model.params == {"heads": "12"} and model.tags["variant"] == "fp32-eager"
    assert {(m.key, m.value, m.run_id) for m in model.metrics} == {("accuracy", 0.75, run.run_id),
                                                                   ("p50_ms_b1", 4.5, other.run_id)}
    texts = ["a great and wonderful film", "awful, boring and far too long " * 20, "ok"]
    loaded = mlflow.pyfunc.load_model(ref.uri)
    assert loaded.metadata.signature.inputs.input_names() == ["text"]
    assert loaded.metadata.get_input_schema().to_dict() == [{"type": "string", "name": "text", "required": True}]
    assert [c["name"] for c in loaded.metadata.get_output_schema().to_dict()] == ["label", "score"]
    assert loaded.metadata.get_model_info().saved_input_example_info is not None
    got = loaded.predict(pd.DataFrame({"text": texts}))
    want = SentimentPredictor(tiny_model_dir, max_chars=64).predict(texts)
    assert got["label"].tolist() == [p.label for p in want]
    assert got["score"].tolist() == pytest.approx([p.score for p in want], abs=1e-6)
    requirements = Path(mlflow.pyfunc.get_model_dependencies(ref.uri)).read_text()
    assert "torch==" in requirements and "mlflow==" in requirements


def test_registering_adds_versions_and_the_alias_moves(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-registry")
    params = _store(tmp_path)
    versions = []
    for round_ in range(2):
        with stage_run(params, "package") as run:
            ref = run.log_external_model(f"m{round_}", tiny_model_dir)
            assert alias_version("reg", "champion") == (versions[-1] if versions else None)
            versions.append(run.register("reg", ref.uri, "unit", {"round": round_}))
            set_alias("reg", "champion", versions[-1])
    assert versions == ["1", "2"] and alias_version("reg", "champion") == "2"
    client = mlflow.MlflowClient()
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'reg'")) == ["1", "2"]
    assert client.get_model_version("reg", "1").tags == {"round": "0"}
    external = client.get_logged_model(ref.model_id)
    assert not ref.files and external.tags["artifact_pointer"] == str(tiny_model_dir.resolve())


def test_parent_run_carries_the_summary_and_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-parent")
    params = _store(tmp_path)
    parent = log_parent_summary(params, {"served_p50_ms": 3.5, "test_accuracy": 0.9, "skipped": "text"},
                                {"served_variant": "int8-static"})
    log_parent_table(params, [{"variant": "a", "p50": 1.0}, {"variant": "b", "p50": 2.0}], "comparison/t.json")
    run = mlflow.get_run(parent)
    assert run.data.tags["pipeline.role"] == "parent" and run.data.tags["served_variant"] == "int8-static"
    assert run.data.metrics == {"served_p50_ms": 3.5, "test_accuracy": 0.9}
    table = mlflow.load_table("comparison/t.json", run_ids=[parent])
    assert table["variant"].tolist() == ["a", "b"] and table["p50"].tolist() == [1.0, 2.0]


def test_a_logged_dataset_has_a_digest_of_its_content(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-data")
    params = _store(tmp_path)
    frame = pd.DataFrame({"text": ["good", "bad"], "label": [1, 0]})
    with stage_run(params, "prepare") as run:
        first = run.log_dataset(frame, "imdb-train", "training", str(tmp_path), targets="label")
        second = run.log_dataset(frame.assign(label=[0, 1]), "imdb-test", "test", str(tmp_path), targets="label")
    assert first != second
    inputs = mlflow.get_run(run.run_id).inputs.dataset_inputs
    by_name = {i.dataset.name: i for i in inputs}
    assert by_name["imdb-train"].dataset.digest == first and by_name["imdb-test"].dataset.digest == second
    assert {t.value for t in by_name["imdb-train"].tags if t.key == "mlflow.data.context"} == {"training"}
