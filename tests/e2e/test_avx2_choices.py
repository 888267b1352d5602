"""End to end: what `make run` chooses and builds on an AVX2-only CPU (no VNNI, no native bf16), rehearsed here with
`PIPELINE_CPU_FLAGS` (fixture `avx2_repo`): every `auto` setting resolves to the AVX2 choice, every record says what
it chose, why, and that the flags were not this CPU's, and the pipeline runs through to a served archive without
the student."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import mlflow
import numpy as np
import pytest

from pipeline.core.machine import ISA_FLAGS
from tests.factories import AVX2_ONLY_FLAGS, product_weights

pytestmark = pytest.mark.slow

OVERRIDE = "PIPELINE_CPU_FLAGS"


def _decided_with_avx2(built_on: dict) -> None:
    """A record made under the override: this CPU's own flags as they are, the AVX2-only ones it decided with."""
    assert built_on["decided_with"] == {"source": OVERRIDE,
                                        "isa": {f: f in AVX2_ONLY_FLAGS.split() for f in ISA_FLAGS}}
    assert set(built_on["isa"]) == set(ISA_FLAGS)


def test_training_runs_in_fp32_and_the_model_record_says_why(avx2_repo: Path):
    meta = json.loads((avx2_repo / "models" / "finetuned" / "pipeline.json").read_text())
    choice = meta["choices"]["train.precision"]
    assert choice["asked"] == "auto" and choice["value"] == "32-true"
    assert "no native bf16" in choice["reason"] and OVERRIDE in choice["reason"]
    _decided_with_avx2(meta["built_on"])
    finetune = json.loads((avx2_repo / "metrics" / "finetune.json").read_text())
    assert finetune["precision"] == "32-true" and finetune["test_accuracy"] > 0.65


def test_int8_weights_are_unsigned_8_bit_in_every_quantized_variant(avx2_repo: Path):
    variants = json.loads((avx2_repo / "metrics" / "variants.json").read_text())
    for name in ("int8-dynamic", "int8-static", "int8-qat", "int8-pruned"):
        assert variants[name]["status"] == "ok", (name, variants[name])
        record = json.loads((avx2_repo / "models" / "variants" / name / "variant.json").read_text())
        assert record["params"]["weight_format"] == "u8", name
        assert "lacks VNNI/AMX" in record["params"]["weight_format_choice"], name
        _decided_with_avx2(record["built_on"])
        weights = product_weights(avx2_repo / "models" / "variants" / name / "model.onnx")
        assert weights and {w.dtype for w in weights} == {np.dtype(np.uint8)}, name
    # unsigned weights keep FP32's decisions (the kernels here are VNNI ones: accuracy, not AVX2 speed)
    for name in ("int8-dynamic", "int8-static"):
        assert variants[name]["agreement_with_fp32"] > 0.9, (name, variants[name])


def test_the_student_is_skipped_with_the_reason_in_every_record(avx2_repo: Path):
    distill = json.loads((avx2_repo / "metrics" / "distill.json").read_text())
    assert distill["status"] == "skipped" and "32-true" in distill["reason"]
    assert distill["enabled"]["asked"] == "auto" and distill["enabled"]["value"] is False
    assert OVERRIDE in distill["enabled"]["reason"]
    variants = json.loads((avx2_repo / "metrics" / "variants.json").read_text())
    for name in ("fp32-distilled", "int8-distilled"):
        assert variants[name]["status"] == "skipped" and variants[name]["reason"] == distill["reason"], name
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{avx2_repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sentiment-pipeline")
    run = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'distill'")[0]
    assert run.data.tags["status"] == "skipped"
    assert run.data.tags["distill.enabled.resolved"].startswith("False (asked auto: ")
    # every run of the rehearsal, the parent included, says its flags were not this CPU's
    runs = client.search_runs([exp.experiment_id], "tags.`pipeline.run_id` = 'e2e-test'")
    assert len(runs) > 10 and all(r.data.tags["cpu.decided_with"].startswith(f"{OVERRIDE}=avx avx2 bmi2 f16c fma")
                                  for r in runs)


def test_benchmark_has_no_bf16_row_and_the_report_says_the_flags_were_rehearsed(avx2_repo: Path):
    bench = json.loads((avx2_repo / "metrics" / "benchmark.json").read_text())
    assert "fp32-eager-bf16" not in bench
    for name in ("fp32-distilled", "int8-distilled"):
        assert bench[name]["status"] == "skipped" and bench[name]["reason"], name
    machine = json.loads((avx2_repo / "metrics" / "benchmark_machine.json").read_text())
    assert machine["bf16_row"] is False and OVERRIDE in machine["bf16_row_choice"]
    _decided_with_avx2(machine)
    report = (avx2_repo / "reports" / "benchmark" / "variants.md").read_text()
    assert f"decided with {OVERRIDE}'s flags, not this CPU's" in report
    assert "| int8-distilled | skipped:" in report


def test_the_served_archive_is_built_from_a_variant_that_was_built(avx2_repo: Path):
    manifest = json.loads((avx2_repo / "metrics" / "package.json").read_text())
    variants = json.loads((avx2_repo / "metrics" / "variants.json").read_text())
    assert variants[manifest["variant"]]["status"] == "ok"
    assert "distilled" not in manifest["variant"]
    with zipfile.ZipFile(avx2_repo / "model_store" / "sentiment.mar") as archive:
        assert json.loads(archive.read("serving.json"))["variant"] == manifest["variant"]
