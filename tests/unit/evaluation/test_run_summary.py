"""Unit: the summary `make run` prints (stage times from this run's MLflow stage runs, headline from metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline.evaluation.run_summary import STAGES, StageTime, headline, render, stage_times

ROOT = Path(__file__).resolve().parents[3]


def test_stages_are_dvc_yaml_stages_in_order():
    assert tuple(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]) == STAGES


def test_stage_times_come_from_this_runs_stage_runs_only(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("exp")
    for run_id, stage, status in (("this", "finetune", "ok"), ("this", "distill", "skipped"),
                                  ("other", "export", "ok")):
        with mlflow.start_run(tags={"pipeline.run_id": run_id, "pipeline.role": "stage", "pipeline.stage": stage,
                                    "status": status}):
            pass
    times = {t.stage: t for t in stage_times(uri, "exp", "this")}
    assert set(times) == set(STAGES)
    assert times["finetune"].status == "ran" and times["finetune"].seconds is not None
    assert times["distill"].status == "skipped"
    assert times["export"] == StageTime("export", None, "up to date")  # another run's stage is not this run's


def test_headline_reads_the_served_variant_and_its_speedup(tmp_path):
    (tmp_path / "finetune.json").write_text(json.dumps({"test_accuracy": 0.898}))
    (tmp_path / "package.json").write_text(json.dumps(
        {"variant": "int8-dynamic", "registered_model": {"uri": "models:/m@champion"}}))
    (tmp_path / "benchmark.json").write_text(json.dumps({
        "fp32-eager": {"status": "ok", "p50_ms_b1": 26.0},
        "int8-dynamic": {"status": "ok", "accuracy": 0.9, "speedup_p50_vs_fp32_eager": 2.0, "speedup_p50_low": 1.9,
                         "speedup_p50_high": 2.1, "p50_ms_b1": 13.0}}))
    (tmp_path / "benchmark_machine.json").write_text(json.dumps(
        {"cpu": "AMD EPYC", "isa": {"avx2": True, "avx512_vnni": False}, "threads_used": 2}))
    head = headline(tmp_path)
    assert head["fp32_test_accuracy"] == 0.898 and head["served"] == "int8-dynamic"
    assert head["speedup"] == 2.0 and head["speedup_interval"] == (1.9, 2.1)
    assert head["cpu"] == "AMD EPYC (avx2; 2 threads)" and head["model_uri"] == "models:/m@champion"
    text = render([StageTime("prepare", 12.0, "ran"), StageTime("finetune", None, "up to date")], head, 600.0)
    assert "2.00x" in text and "89.80 %" in text and "10 min 00 s" in text


def test_headline_of_a_run_without_metrics_is_empty(tmp_path):
    assert headline(tmp_path) == {}
    assert "served variant" not in render([], {}, None)
