"""End to end, `make test-all`: the opt-in parts of the pipeline in a second miniature `dvc repro` (fixture
`repo_opt_in`: `profiles/mini.yaml` plus `OPT_IN` of tests/conftest.py: the student, the pruned variant and the
TensorRT engine's QDQ input), with the same AVX2-only rehearsal as `repo`. The default miniature records these
parts as skipped (tests/e2e/test_repro.py); here they are built, scored, and their servable variants pass the
behaviour tier."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest

from pipeline.core.machine import FLAGS_OVERRIDE_ENV
from pipeline.deployment.inference import SentimentPredictor
from pipeline.runtimes.record import read_variant
from tests.factories import product_weights

# The behaviour tier's tests, collected again here against the opt-in variants (the `predictor` fixture below).
from tests.model.test_behaviour import (  # noqa: F401
    OPT_IN_VARIANTS,
    test_batch_order_and_single_agree,
    test_clear_reviews,
    test_eight_threads_get_each_review_answered_as_alone,
    test_names_do_not_matter,
    test_negation_lowers_positive_probability,
)

pytestmark = pytest.mark.slow  # a second whole miniature run


@pytest.fixture(scope="module", params=OPT_IN_VARIANTS)
def predictor(request, repo_opt_in: Path) -> SentimentPredictor:
    directory = repo_opt_in / "models" / "variants" / request.param
    info = read_variant(directory)
    assert info.status == "ok", f"the opt-in miniature must build every opt-in variant: {request.param} {info.reason}"
    return SentimentPredictor(directory)


def test_the_pruned_and_distilled_variants_are_built_smaller(repo_opt_in: Path):
    repo = repo_opt_in
    v = json.loads((repo / "metrics" / "variants.json").read_text())
    for name in OPT_IN_VARIANTS:
        assert v[name]["status"] == "ok", (name, v[name])
    for name in ("int8-pruned", "int8-distilled", "int8-distilled-openvino"):
        assert v[name]["size_mb"] < 0.35 * v["fp32-onnx"]["size_mb"]
    # the miniature profile prunes to 8 of 12 heads and 768 of 1536 neurons: fewer weights than int8-dynamic's
    assert v["int8-pruned"]["size_mb"] < 0.85 * v["int8-dynamic"]["size_mb"]
    pruned = json.loads((repo / "models" / "variants" / "int8-pruned" / "variant.json").read_text())
    assert pruned["params"]["heads"] == 8 and pruned["params"]["ffn_width"] == 768
    assert pruned["params"]["fusions"]["Attention"] == 6
    assert pruned["params"]["weight_format"] == "u8"  # the AVX2 rehearsal's choice, as for the default's variants
    weights = product_weights(repo / "models" / "variants" / "int8-pruned" / "model.onnx")
    assert weights and {w.dtype for w in weights} == {np.dtype(np.uint8)}
    # the student: 3 of 6 layers, trained on the teacher's predictions for 800 + 200 reviews
    distill = json.loads((repo / "metrics" / "distill.json").read_text())
    assert distill["student_layers"] == 3 and distill["transfer_reviews"] == 200
    assert v["fp32-distilled"]["size_mb"] < v["fp32-onnx"]["size_mb"]
    assert v["int8-distilled"]["size_mb"] < v["int8-dynamic"]["size_mb"]
    assert v["int8-distilled-openvino"]["size_mb"] < v["int8-openvino"]["size_mb"]
    for name in ("fp32-distilled", "int8-distilled", "int8-distilled-openvino"):
        assert v[name]["accuracy"] > 0.6, (name, v[name])
    student = json.loads((repo / "models" / "distilled" / "pipeline.json").read_text())
    assert student["distillation"]["kept_layers"] == [1, 3, 5]
    assert distill["resumed"] is False and "fresh start" in distill["resume_reason"] and distill["train_steps"] > 0
    assert "distill: fresh start" in (repo / "repro.log").read_text()
    report = (repo / "reports" / "benchmark" / "variants.md").read_text()
    assert "## Where the speed-up comes from" in report and "| smaller model" in report


def test_tensorrt_int8_input_keeps_fp32_decisions_on_the_test_split(repo_opt_in):
    """The INT8 engine's QDQ input, run by onnxruntime on the test split: a PTQ model, so it keeps FP32's
    decisions like int8-static does (whether or not a GPU built the engine)."""
    from pipeline.data.tokens import read_tokenized
    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.ort import OrtRunner

    variants = repo_opt_in / "models" / "variants"
    record = json.loads((variants / "tensorrt-int8" / "variant.json").read_text())["params"]
    test = read_tokenized(repo_opt_in / "data" / "tokenized", "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    fp32 = predict_logits(OrtRunner(variants / "fp32-onnx" / "model.onnx"), seqs, 32).argmax(-1)
    int8 = predict_logits(OrtRunner(variants / "tensorrt-int8" / record["source_onnx"]), seqs, 32).argmax(-1)
    assert (int8 == fp32).mean() > 0.9
    assert (int8 == labels).mean() > (fp32 == labels).mean() - 0.05


def test_an_explicit_student_trains_in_fp32_and_every_record_says_so(repo_opt_in: Path):
    distill = json.loads((repo_opt_in / "metrics" / "distill.json").read_text())
    assert distill["precision"] == "32-true"
    assert distill["enabled"] == {"setting": "distill.enabled", "asked": True, "value": True,
                                  "reason": "set explicitly"}
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo_opt_in / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sentiment-pipeline")
    run = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'distill'")[0]
    assert run.data.tags["status"] == "ok"
    assert run.data.tags["distill.enabled.resolved"] == "True (asked True: set explicitly)"
    # every run of the rehearsal, the parent included, says its flags were not this CPU's
    runs = client.search_runs([exp.experiment_id], "tags.`pipeline.run_id` = 'e2e-test'")
    flags = f"{FLAGS_OVERRIDE_ENV}=avx avx2 bmi2 f16c fma"
    assert len(runs) > 10 and all(r.data.tags["cpu.decided_with"].startswith(flags) for r in runs)
