"""Unit: `benchmarks.peers` and `benchmarks.peer_runtimes` on the tiny model: every runtime builds and gives FP32
eager's labels (INT8 runtimes: wherever eager's logit margin is clear of their rounding), the run writes the rows
the issue's schema names, and the INT8-ceiling arithmetic. Never timings."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from benchmarks.peer_report import ceiling_fraction, weight_gemm_flops
from benchmarks.peer_rows import Inputs, build_row, read_inputs
from benchmarks.peer_runtimes import PeerSpec, PeerUnavailable, specs
from benchmarks.peers import main
from pipeline.core.io import read_json, write_json
from pipeline.core.params import BenchmarkParams, Params, QuantizeParams

#: A row whose labels may differ from FP32 eager's only where eager's |logit difference| is below this margin: the
#: tiny random model's logits sit close together, so INT8 rounding can flip a near-tie, never a clear answer.
INT8_MARGIN = 0.05


@pytest.fixture(scope="module")
def inputs(built, tiny_model_dir) -> Inputs:
    params = Params(quantize=QuantizeParams(calibration_samples=16, calibration_batch_size=8),
                    benchmark=BenchmarkParams(seq_len=16))  # the synthetic reviews are short: 16 real tokens
    return read_inputs(tiny_model_dir, built["tokenized"], params, None)


def _logits(runtime, inputs: Inputs) -> np.ndarray:
    from pipeline.runtimes.base import predict_logits

    return predict_logits(runtime, inputs.test_seqs, 64, inputs.pad)  # one batch: one compile


@pytest.fixture(scope="module")
def eager(built, tiny_model_dir, inputs) -> np.ndarray:
    spec = PeerSpec("pytorch-eager", "fp32", "teacher")
    return _logits(build_row(spec, {}, tiny_model_dir, built["root"], 1, inputs, "aot_eager"), inputs)


#: The compiled rows take minutes to trace on 2 cores even through `aot_eager`: marked slow.
ROWS = [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if "compile" in s.runtime else [])
        for s in specs(["teacher"]) if s.runtime != "pytorch-eager"]


@pytest.mark.parametrize("spec", ROWS)
def test_every_runtime_builds_and_agrees_with_fp32_eager(spec, built, tiny_model_dir, inputs, eager):
    """Each peer (compiled through `aot_eager` here, so no C++ build: dynamo, AOTAutograd and torchao's tensor
    subclasses are still traced) and each of the pipeline's variants answers the test reviews like FP32 eager."""
    try:
        runtime = build_row(spec, {}, tiny_model_dir, built["root"], 1, inputs, "aot_eager")
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    logits = _logits(runtime, inputs)
    assert logits.shape == eager.shape and np.isfinite(logits).all()
    margin = np.abs(eager[:, 1] - eager[:, 0])
    same = logits.argmax(1) == eager.argmax(1)
    if "int8" in spec.precision:
        assert (margin > INT8_MARGIN).sum() >= len(margin) // 4, "too few clear answers to compare"
        assert same[margin > INT8_MARGIN].all()
        assert same.mean() >= 0.9
    else:
        np.testing.assert_allclose(logits, eager, atol=1e-3)
        assert same[margin > 1e-3].all()
    described = runtime.describe()
    assert described["runtime"] == spec.runtime and described["build_s"] > 0


def test_bf16_autocast_is_skipped_without_native_bf16(built, tiny_model_dir, inputs, monkeypatch):
    monkeypatch.setenv("PIPELINE_CPU_FLAGS", "avx avx2 fma")
    with pytest.raises(PeerUnavailable, match="no native bf16"):
        build_row(PeerSpec("torch.compile", "bf16-autocast", "teacher"), {}, tiny_model_dir, built["root"], 1,
                  inputs, "aot_eager")


def test_a_missing_variant_is_unavailable_with_the_reason(tiny_model_dir, inputs, tmp_path):
    spec = PeerSpec("onnxruntime", "int8-dynamic", "teacher", True, "int8-dynamic")
    with pytest.raises(PeerUnavailable, match="int8-dynamic"):
        build_row(spec, {}, tiny_model_dir, tmp_path, 1, inputs, "aot_eager")


@pytest.mark.slow  # builds and times every row: `make test-all`
def test_run_writes_the_schema_with_skipped_rows_and_the_ceiling(built, tiny_model_dir, tmp_path):
    """A whole run on a subset of rows: every row of the schema, ours marked, the absent student skipped with
    its reason, peak RSS from a fresh process, the verdicts and the INT8-ceiling share."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "benchmark": {"rounds": 2, "iterations": 2, "warmup": 1, "latency_reviews": 2, "batch_size": 4,
                      "seq_len": 16},
        "quantize": {"calibration_samples": 8, "calibration_batch_size": 4}}))
    ceiling = tmp_path / "ceiling.json"
    write_json(ceiling, {"tokens": 128, "products": [
        {"product": "a", "k": 64, "n": 64, "int8-gemm-only_p50_ms": 1.0},
        {"product": "b", "k": 64, "n": 256, "int8-gemm-only_p50_ms": 2.0}]})
    out = tmp_path / "peers.json"
    main(["--params", str(params), "--finetuned", str(tiny_model_dir), "--student", str(tmp_path / "none"),
          "--variants-root", str(built["root"]), "--tokenized", str(built["tokenized"]), "--threads", "1",
          "--rows", "onnxruntime/int8-dynamic", "--ort-tuning", "--ceiling", str(ceiling), "--out", str(out),
          "--compile-backend", "aot_eager"])
    result = read_json(out)
    assert result["machine"]["cpu"] and "avx2" in result["machine"]["isa"]
    assert len(result["machine"]["loadavg_start"]) == 3
    rows = {r["name"]: r for r in result["rows"]}
    keys = ("runtime", "model", "precision", "accuracy", "p50_ms_b1", "p95_ms_b1", "reviews_per_s_b32",
            "peak_rss_mb", "build_s", "ours")
    measured = [r for r in result["rows"] if r["status"] == "ok"]
    assert {r["name"] for r in measured} >= {"teacher/pytorch-eager/fp32", "teacher/onnxruntime/int8-dynamic"}
    for r in measured:
        assert all(r.get(k) is not None for k in keys), {k: r.get(k) for k in (*keys, "peak_rss_error")}
        assert 0 <= r["accuracy"] <= 1 and r["peak_rss_mb"] > 0
    assert rows["teacher/onnxruntime/int8-dynamic"]["ours"] and not rows["teacher/pytorch-eager/fp32"]["ours"]
    assert rows["teacher/pytorch-eager/fp32"]["agreement_with_fp32"] == 1.0
    students = [r for r in result["rows"] if r["model"] == "student"]
    assert students and all(r["status"] == "skipped" and "student" in r["reason"] for r in students)
    assert rows["teacher/onnxruntime/int8-static"]["status"] == "skipped"  # not asked for
    # the onnxruntime tuning rows run the built variant under other session settings
    for tag in ("no-spin", "parallel", "batched"):
        tuned = rows[f"teacher/onnxruntime/int8-dynamic+{tag}"]
        assert tuned["status"] == "ok" and tuned["ours"] and tuned["options"], tuned.get("reason")
    share = result["int8_ceiling"]
    fastest = max((r for r in measured if r["ours"]), key=lambda r: r["reviews_per_s_b32"])  # a tuning row may win
    assert share["row"] == fastest["name"] and share["peak_product"] == "b"
    assert share["fraction_of_peak"] == pytest.approx(
        share["gemm_flops_per_review"] * rows[share["row"]]["reviews_per_s_b32"] / (2 * 128 * 64 * 256 / 2e-3))
    assert out.with_suffix(".png").stat().st_size > 0


def test_weight_gemm_flops_counts_the_readout_layer_at_cls_only():
    config = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2}
    per_token = 4 * 16 + 2 * 32  # Q, K, V, output (h x h) and FFN up and down (h x i)
    assert weight_gemm_flops(config, 10, False) == 2 * 2 * 10 * per_token
    # the last layer: K and V for all 10 tokens, Q, output and the FFN for [CLS] alone
    assert weight_gemm_flops(config, 10, True) == 2 * (10 * per_token + 10 * 2 * 16 + (2 * 16 + 2 * 32))


def test_ceiling_fraction_needs_the_ceiling_file(tmp_path):
    row = {"name": "r", "reviews_per_s_b32": 1.0}
    batch = (np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))
    assert ceiling_fraction(row, {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1}, [batch],
                            tmp_path / "absent.json") is None


def test_ceiling_fraction_refuses_a_peak_measured_on_another_cpu(tmp_path):
    """The INT8 peak belongs to the CPU it was measured on: a ceiling file from another ISA gives a reason, no share."""
    from pipeline.core.machine import isa_record

    here = isa_record()
    other = {**here["isa"], "avx2": not here["isa"]["avx2"]}
    ceiling = tmp_path / "ceiling.json"
    write_json(ceiling, {"tokens": 8, "machine": {"cpu": here["cpu"], "isa": other},
                         "products": [{"product": "a", "k": 4, "n": 4, "int8-gemm-only_p50_ms": 1.0}]})
    row = {"name": "r", "reviews_per_s_b32": 1.0}
    batch = (np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))
    config = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1}
    share = ceiling_fraction(row, config, [batch], ceiling)
    assert set(share) == {"row", "skipped"} and "another CPU" in share["skipped"]
    write_json(ceiling, {"tokens": 8, "machine": here,
                         "products": [{"product": "a", "k": 4, "n": 4, "int8-gemm-only_p50_ms": 1.0}]})
    assert ceiling_fraction(row, config, [batch], ceiling)["fraction_of_peak"] > 0
