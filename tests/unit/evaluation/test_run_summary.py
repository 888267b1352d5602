"""Unit: the summary `make run` prints (stage times from this run's MLflow stage runs, headline from metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline.evaluation.run_summary import STAGES, StageTime, headline, render, stage_times

ROOT = Path(__file__).resolve().parents[3]


def test_stages_are_dvc_yaml_stages_in_order():
    assert tuple(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]) == STAGES


def test_stage_times_are_this_runs_lines_of_the_stage_log(tmp_path, monkeypatch):
    """Every stage process appends its time (`run_stage`); the summary keeps this run's newest line per stage and
    shows stages that did not run as up to date."""
    from pipeline.core.stage import STAGE_LOG_ENV, run_stage

    log = tmp_path / "stages.jsonl"
    monkeypatch.setenv(STAGE_LOG_ENV, str(log))
    run_stage(name="export", body=lambda: None, run_id="other")
    run_stage(name="finetune", body=lambda: None, run_id="this")
    run_stage(name="prepare", body=lambda: None, run_id="this")
    with log.open("a") as f:
        f.write('{"run_id": "this", "stage": "distill", "outcome": "do')  # cut off by a killed process
    times = {t.stage: t for t in stage_times(log, "this")}
    assert set(times) == set(STAGES)
    assert times["finetune"].status == "ran" and times["finetune"].seconds is not None
    assert times["prepare"].status == "ran"
    assert times["export"] == StageTime("export", None, "up to date")  # another run's stage is not this run's
    assert times["distill"] == StageTime("distill", None, "up to date")


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


def test_durations_round_to_whole_seconds_before_minutes_are_counted():
    from pipeline.evaluation.run_summary import _duration

    assert [_duration(s) for s in (0.4, 45.6, 89.4, 89.6, 746.2, 1559.7, 1559.4)] == [
        "0 s", "46 s", "89 s", "1 min 30 s", "12 min 26 s", "26 min 00 s", "25 min 59 s"]


def test_the_summary_shows_every_variant_this_run_built_and_why_the_rest_were_not(tmp_path):
    """Issue 43 item 5: the summary lists each variant with the figures its stages measured (catalog order), marks
    the served one, the timing rows and rows timed in fewer rounds, and groups the rest by why they were not built
    or timed; a variant the benchmark did not time keeps its accuracy."""
    from pipeline.evaluation.run_summary import render_variants, variant_rows

    (tmp_path / "variants.json").write_text(json.dumps({
        "fp32-eager": {"status": "ok", "accuracy": 0.898, "accuracy_delta_pt": 0.0},
        "int8-static": {"status": "ok", "accuracy": 0.8947, "accuracy_delta_pt": -0.33},
        "int8-dynamic": {"status": "ok", "accuracy": 0.896, "accuracy_delta_pt": -0.2},
        "int8-openvino": {"status": "ok", "accuracy": 0.8953, "accuracy_delta_pt": -0.27},
        "int8-pruned": {"status": "skipped", "reason": "prune.enabled is false"},
        "fp32-distilled": {"status": "skipped", "reason": "distill.enabled is false (make run PROFILE=full)"},
        "int8-distilled": {"status": "skipped", "reason": "distill.enabled is false (make run PROFILE=full)"}}))
    (tmp_path / "benchmark.json").write_text(json.dumps({
        "fp32-eager": {"status": "ok", "p50_ms_b1": 13.6, "speedup_p50_vs_fp32_eager": 1.0, "rounds": 5},
        "fp32-eager-bf16": {"status": "ok", "p50_ms_b1": 11.5, "speedup_p50_vs_fp32_eager": 1.22, "rounds": 3},
        "int8-dynamic": {"status": "ok", "p50_ms_b1": 5.0, "speedup_p50_vs_fp32_eager": 2.71, "rounds": 5},
        "int8-static": {"status": "ok", "p50_ms_b1": 4.7, "speedup_p50_vs_fp32_eager": 2.9, "rounds": 5},
        "int8-openvino": {"status": "failed", "reason": "RuntimeError: no CPU plugin; see the log"},
        "int8-pruned": {"status": "skipped", "reason": "prune.enabled is false"},
        "tensorrt-int8": {"status": "skipped", "reason": "no CUDA device visible (no NVIDIA driver); needs a GPU"}}))
    rows = variant_rows(tmp_path)
    assert [r.name for r in rows] == ["fp32-eager", "fp32-eager-bf16", "int8-dynamic", "int8-static",
                                      "int8-openvino", "int8-pruned", "fp32-distilled", "int8-distilled",
                                      "tensorrt-int8"]
    lines = render_variants(rows, served="int8-static")
    table = {line.split()[0]: line for line in lines[1:] if line and not line.startswith(("skipped", "failed"))}
    assert table["int8-static"].split() == ["int8-static", "89.47", "%", "-0.33", "pt", "4.7", "ms", "2.90x",
                                            "served"]
    assert table["fp32-eager"].split()[1:5] == ["89.80", "%", "-", "13.6"]  # no difference to itself
    assert table["fp32-eager-bf16"].endswith("timing only, timed in 3 of 5 rounds")
    assert "served" not in table["int8-dynamic"] and "rounds" not in table["int8-dynamic"]
    assert "int8-openvino" not in table  # its benchmark failed: listed with the reason, not with half its figures
    assert "failed (RuntimeError: no CPU plugin): int8-openvino" in lines
    assert "skipped (prune.enabled is false): int8-pruned" in lines
    assert "skipped (distill.enabled is false): fp32-distilled, int8-distilled" in lines
    assert "skipped (no CUDA device visible): tensorrt-int8" in lines
    text = render([], headline(tmp_path), None, rows)
    assert "int8-static" in text and "skipped (prune.enabled is false)" in text


def test_a_run_without_variant_metrics_has_no_variants_table(tmp_path):
    from pipeline.evaluation.run_summary import render_variants, variant_rows

    assert variant_rows(tmp_path) == [] and render_variants([], None) == []
