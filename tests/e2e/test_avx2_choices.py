"""End to end: what `make run` chooses and builds on an AVX2-only CPU (no VNNI, no native bf16), rehearsed with
`PIPELINE_CPU_FLAGS` by the session's one miniature run (fixture `repo`): every `auto` setting resolves to the AVX2
choice (no bf16 timing row: emulated bf16 would only time the emulation; an explicit row is timed by
tests/unit/evaluation/test_latency.py), and every record says what it chose, why, and that the flags were not this
CPU's. The explicit student on such a CPU is checked by
tests/e2e/test_opt_in.py's run (`make test-all`); what `auto` does with it (skipped, with the reason in every
record) on the tiny model in tests/unit/training/test_distill.py."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from pipeline.core.machine import FLAGS_OVERRIDE_ENV, ISA_FLAGS
from tests.factories import AVX2_ONLY_FLAGS, product_weights


def _decided_with_avx2(built_on: dict) -> None:
    """A record made under the override: this CPU's own flags as they are, the AVX2-only ones it decided with."""
    assert built_on["decided_with"] == {"source": FLAGS_OVERRIDE_ENV,
                                        "isa": {f: f in AVX2_ONLY_FLAGS.split() for f in ISA_FLAGS}}
    assert set(built_on["isa"]) == set(ISA_FLAGS)


def test_training_runs_in_fp32_and_the_model_record_says_why(repo: Path):
    meta = json.loads((repo / "models" / "finetuned" / "pipeline.json").read_text())
    choice = meta["choices"]["train.precision"]
    assert choice["asked"] == "auto" and choice["value"] == "32-true"
    assert "no native bf16" in choice["reason"] and FLAGS_OVERRIDE_ENV in choice["reason"]
    _decided_with_avx2(meta["built_on"])
    finetune = json.loads((repo / "metrics" / "finetune.json").read_text())
    assert finetune["precision"] == "32-true" and finetune["test_accuracy"] > 0.65


def test_int8_weights_are_unsigned_8_bit_in_every_quantized_variant(repo: Path):
    variants = json.loads((repo / "metrics" / "variants.json").read_text())
    for name in ("int8-dynamic", "int8-static", "int8-qat"):
        assert variants[name]["status"] == "ok", (name, variants[name])
        record = json.loads((repo / "models" / "variants" / name / "variant.json").read_text())
        assert record["params"]["weight_format"] == "u8", name
        assert "lacks VNNI/AMX" in record["params"]["weight_format_choice"], name
        _decided_with_avx2(record["built_on"])
        weights = product_weights(repo / "models" / "variants" / name / "model.onnx")
        assert weights and {w.dtype for w in weights} == {np.dtype(np.uint8)}, name
    # unsigned weights keep FP32's decisions (the kernels here are VNNI ones: accuracy, not AVX2 speed)
    for name in ("int8-dynamic", "int8-static"):
        assert variants[name]["agreement_with_fp32"] > 0.9, (name, variants[name])


def test_no_bf16_row_without_native_bf16_and_the_report_says_the_flags_were_rehearsed(repo: Path):
    bench = json.loads((repo / "metrics" / "benchmark.json").read_text())
    assert "fp32-eager-bf16" not in bench
    machine = json.loads((repo / "metrics" / "benchmark_machine.json").read_text())
    assert machine["bf16_row"] is False and machine["bf16_row_choice"].startswith("False (asked auto: CPU has no "
                                                                                   "native bf16")
    assert FLAGS_OVERRIDE_ENV in machine["bf16_row_choice"]
    _decided_with_avx2(machine)
    report = (repo / "reports" / "benchmark" / "variants.md").read_text()
    assert f"decided with {FLAGS_OVERRIDE_ENV}'s flags, not this CPU's" in report


def test_the_served_archive_is_built_from_a_variant_that_was_built(repo: Path):
    manifest = json.loads((repo / "metrics" / "package.json").read_text())
    variants = json.loads((repo / "metrics" / "variants.json").read_text())
    assert variants[manifest["variant"]]["status"] == "ok"
    with zipfile.ZipFile(repo / "model_store" / "sentiment.mar") as archive:
        assert json.loads(archive.read("serving.json"))["variant"] == manifest["variant"]
