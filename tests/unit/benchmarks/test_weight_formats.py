"""Unit: `benchmarks.weight_formats` builds each model in each asked format with the pipeline's int8-dynamic
recipe, in that format's grid, and times them against FP32 eager."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from benchmarks.weight_formats import main, saturation_note
from pipeline.core.io import read_json
from pipeline.runtimes.record import read_variant
from tests.factories import product_weights


@pytest.fixture
def small_params(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({
        "benchmark": {"rounds": 1, "iterations": 2, "warmup": 1, "latency_reviews": 2, "batch_size": 4,
                      "seq_len": 16}}))  # the synthetic reviews are short: timed at 16 real tokens
    return path


@pytest.mark.slow  # builds and times every format: `make test-all`
def test_each_format_is_built_in_its_grid_and_timed(built, tiny_model_dir, small_params, tmp_path):
    out = tmp_path / "formats.json"
    work = tmp_path / "work"
    args = ["--params", str(small_params), "--models", f"int8-dynamic={tiny_model_dir}", "--reference",
            str(tiny_model_dir), "--variants-root", str(built["root"]), "--tokenized", str(built["tokenized"]),
            "--formats", "u8,s7", "--work", str(work), "--threads", "1", "--out", str(out)]
    main(args)
    result = read_json(out)
    assert [r["row"] for r in result["rows"]] == ["fp32-eager", "fp32-onnx", "int8-dynamic u8", "int8-dynamic s7"]
    assert all(r["p50_ms_b1"] > 0 and r["throughput_b32"] > 0 for r in result["rows"])
    assert result["rows"][0]["speedup_p50"] == 1.0
    assert result["machine"]["cpu"] and result["auto"] in ("s8", "u8")
    for fmt, dtype, low, high in (("u8", np.uint8, 0, 255), ("s7", np.int8, -64, 64)):
        model = work / fmt / "int8-dynamic"
        assert read_variant(model).params["weight_format"] == fmt
        weights = product_weights(model / "model.onnx")
        assert weights and all(w.dtype == dtype and int(w.min()) >= low and int(w.max()) <= high for w in weights)
    built_at = (work / "u8" / "int8-dynamic" / "model.onnx").stat().st_mtime_ns
    main(args)  # the same model and settings: the builds are reused, not rebuilt
    assert (work / "u8" / "int8-dynamic" / "model.onnx").stat().st_mtime_ns == built_at


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="s9"):
        main(["--formats", "u8,s9", "--work", str(tmp_path)])
    with pytest.raises(SystemExit, match="NAME=DIR"):
        main(["--models", "models/finetuned", "--work", str(tmp_path)])


def test_s8_is_flagged_as_saturating_by_this_cpus_flags_not_the_rehearsed_ones(monkeypatch):
    """The note follows the flags the timed kernels run on: a VNNI CPU rehearsing AVX2 decisions
    (`PIPELINE_CPU_FLAGS`) still times exact s8 kernels, and an AVX2 CPU saturates s8 whatever it rehearses."""
    from pipeline.core.machine import FLAGS_OVERRIDE_ENV

    monkeypatch.setenv(FLAGS_OVERRIDE_ENV, "avx2 fma")
    assert saturation_note(["s8", "u8"], frozenset({"avx2", "avx512_vnni"})) == ""
    monkeypatch.setenv(FLAGS_OVERRIDE_ENV, "avx2 avx512_vnni")
    assert "saturates" in saturation_note(["s8", "u8"], frozenset({"avx2", "fma"}))
    assert saturation_note(["u8", "s7"], frozenset({"avx2"})) == ""
