"""End to end: `dvc repro` on a miniature profile in a temporary copy of the repo (fixture `repo`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

def test_repro_outputs_and_metrics(repo):
    m = json.loads((repo / "metrics" / "finetune.json").read_text())
    assert m["test_accuracy"] > 0.65, m  # 800 reviews of 64 tokens: well above chance, far from the full run
    assert m["train_samples_per_s"] > 0
    prep = json.loads((repo / "metrics" / "prepare.json").read_text())
    assert prep["sizes"] == {"train": 800, "val": 100, "test": 300}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "pipeline.json"):
        assert (repo / "models" / "finetuned" / f).is_file()
    assert (repo / "plots" / "finetune" / "train.csv").read_text().count("\n") > 10


def test_variants_metrics(repo):
    v = json.loads((repo / "metrics" / "variants.json").read_text())
    assert set(v) == {"fp32-eager", "fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat",
                      "int8-pruned", "tensorrt-fp16", "tensorrt-int8"}
    for name in ("fp32-torchscript", "fp32-onnx"):
        assert v[name]["agreement_with_fp32"] == 1.0
        assert v[name]["accuracy"] == v["fp32-eager"]["accuracy"]
    for name in ("int8-dynamic", "int8-static", "int8-qat", "int8-pruned"):
        assert v[name]["status"] == "ok"
        assert v[name]["size_mb"] < 0.35 * v["fp32-onnx"]["size_mb"]
    # the miniature profile prunes to 8 of 12 heads and 768 of 1536 neurons: fewer weights than int8-dynamic's
    assert v["int8-pruned"]["size_mb"] < 0.85 * v["int8-dynamic"]["size_mb"]
    pruned = json.loads((repo / "models" / "variants" / "int8-pruned" / "variant.json").read_text())["params"]
    assert pruned["heads"] == 8 and pruned["ffn_width"] == 768 and pruned["fusions"]["Attention"] == 6
    for name in ("int8-dynamic", "int8-static"):  # PTQ keeps the FP32 weights' decisions
        assert v[name]["agreement_with_fp32"] > 0.9, (name, v[name])
    # QAT trains further, so it may disagree with FP32 more; it must not lose accuracy badly.
    assert v["int8-qat"]["accuracy"] > v["fp32-eager"]["accuracy"] - 0.05, v["int8-qat"]
    # The FP32 row reuses the finetune stage's test logits: the same number, not a second scoring pass.
    finetune = json.loads((repo / "metrics" / "finetune.json").read_text())
    assert v["fp32-eager"]["scored_by"] == "finetune"
    assert v["fp32-eager"]["accuracy"] == finetune["test_accuracy"]
    qat = json.loads((repo / "models" / "variants" / "int8-qat" / "variant.json").read_text())["params"]
    assert qat["qat_max_length"] <= 48  # QAT trains on the finetune window (train.max_length), not 64 tokens
    import torch

    if not torch.cuda.is_available():
        for name in ("tensorrt-fp16", "tensorrt-int8"):
            assert v[name]["status"] == "skipped" and "CUDA" in v[name]["reason"]


def test_tensorrt_int8_input_keeps_fp32_decisions_on_the_test_split(repo):
    """The INT8 engine's QDQ input, run by onnxruntime on the test split: a PTQ model, so it keeps FP32's
    decisions like int8-static does (whether or not a GPU built the engine)."""
    from pipeline.data.tokens import read_tokenized
    from pipeline.variants.runners import OrtRunner, predict_logits

    variants = repo / "models" / "variants"
    record = json.loads((variants / "tensorrt-int8" / "variant.json").read_text())["params"]
    test = read_tokenized(repo / "data" / "tokenized", "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    fp32 = predict_logits(OrtRunner(variants / "fp32-onnx" / "model.onnx"), seqs, 32).argmax(-1)
    int8 = predict_logits(OrtRunner(variants / "tensorrt-int8" / record["source_onnx"]), seqs, 32).argmax(-1)
    assert (int8 == fp32).mean() > 0.9
    assert (int8 == labels).mean() > (fp32 == labels).mean() - 0.05


def test_benchmark_report_and_package(repo):
    bench = json.loads((repo / "metrics" / "benchmark.json").read_text())
    variants = json.loads((repo / "metrics" / "variants.json").read_text())
    assert set(bench) == set(variants) | {"fp32-eager-bf16"}
    for name, entry in bench.items():
        if entry["status"] == "ok":
            assert entry["p50_ms_b1"] <= entry["p95_ms_b1"] <= entry["p99_ms_b1"]
            assert entry["throughput_b32"] > 0 and entry["peak_rss_mb"] > 50
        else:
            assert name.startswith("tensorrt") and entry["reason"]
    assert bench["fp32-eager"]["speedup_p50_vs_fp32_eager"] == 1.0
    report = (repo / "reports" / "benchmark" / "variants.md").read_text()
    assert "| int8-static |" in report and "skipped" in report and "## Targets" in report
    assert (repo / "reports" / "benchmark" / "variants_latency.png").stat().st_size > 5000
    manifest = json.loads((repo / "metrics" / "package.json").read_text())
    assert manifest["variant"] in variants and (repo / "model_store" / "sentiment.mar").stat().st_size > 1e6
    assert manifest["model"].startswith("imdb-sentiment:v1/")


def test_second_repro_is_a_noop(repo):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    assert "didn't change, skipping" in proc.stdout and "Running stage" not in proc.stdout


def test_mlflow_parent_with_stage_children_and_registered_model(repo):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sentiment-pipeline")
    runs = client.search_runs([exp.experiment_id], "tags.`pipeline.run_id` = 'e2e-test'")
    parents = [r for r in runs if r.data.tags.get("pipeline.role") == "parent"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    stages = {r.data.tags["pipeline.stage"] for r in children}
    assert {"prepare", "finetune", "export", "quantize", "prune", "tensorrt", "evaluate", "benchmark",
            "package"} <= stages
    finetune = next(r for r in children if r.data.tags["pipeline.stage"] == "finetune")
    assert finetune.data.metrics["test_accuracy"] > 0.65
    assert "train.lr" in finetune.data.params
    logged = {a.path for a in client.list_artifacts(finetune.info.run_id, "predictions")}
    assert logged == {"predictions/finetune-test.npz"}
    variant_runs = {r.data.tags.get("variant") for r in children if r.data.tags.get("variant")}
    assert "int8-static" in variant_runs and "tensorrt-int8" in variant_runs
    versions = client.search_model_versions("name = 'imdb-sentiment'")
    assert versions and versions[0].run_id == finetune.info.run_id
