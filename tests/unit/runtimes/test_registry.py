"""Unit: every variant format has exactly one runtime, each in a module of its own, and `load_runner` dispatches on
a variant record's format (refusing a skipped variant and an unknown format by name)."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from pipeline.runtimes.catalog import Format
from pipeline.runtimes.record import VARIANT_FILE, VariantError, VariantInfo, write_variant
from pipeline.runtimes.registry import RUNTIMES, load_runner


def test_every_format_has_one_runtime_in_a_module_of_its_own():
    assert set(RUNTIMES) == set(get_args(Format))
    assert {fmt: cls.format for fmt, cls in RUNTIMES.items()} == {fmt: fmt for fmt in RUNTIMES}
    modules = [cls.__module__ for cls in RUNTIMES.values()]
    assert len(set(modules)) == len(modules) and all(m.startswith("pipeline.runtimes.") for m in modules)


def test_a_skipped_variant_and_an_unknown_format_are_refused_by_name(tmp_path, tiny_model_dir):
    skipped = tmp_path / "tensorrt-fp16"
    write_variant(skipped, VariantInfo.skipped("tensorrt-fp16", "no CUDA device visible", {}), tiny_model_dir)
    with pytest.raises(VariantError, match="tensorrt-fp16 was skipped: no CUDA device visible"):
        load_runner(skipped)
    odd = tmp_path / "odd"
    odd.mkdir()
    record = {**VariantInfo("odd", "onnx", "float32", "model.onnx").to_dict(), "format": "tflite"}
    (odd / VARIANT_FILE).write_text(json.dumps(record))
    with pytest.raises(VariantError, match="unknown variant format 'tflite'"):
        load_runner(odd)
