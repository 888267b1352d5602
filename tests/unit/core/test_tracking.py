"""Unit: MLflow bookkeeping lives in `pipeline.core.tracking` alone, and a tracked stage records what its work
returns (numbers as metrics, statuses and reasons as tags, files as artifacts) in a real SQLite store."""

from __future__ import annotations

import ast
from pathlib import Path

import mlflow

from pipeline.core.params import MlflowParams, Params
from pipeline.core.tracking import tracked_stage
from tests.factories import ROOT

TRACKING = ROOT / "pipeline" / "core" / "tracking.py"


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


def test_only_the_tracking_module_talks_to_mlflow():
    files = [p for d in ("pipeline", "stages", "serving") for p in (ROOT / d).rglob("*.py") if p != TRACKING]
    assert files and _imports_mlflow(TRACKING)  # the scan does see an import where there is one
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
