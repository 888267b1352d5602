"""The variant registry: one row per variant, and the records the builders write follow it."""

from __future__ import annotations

import pytest

from pipeline.runtimes.catalog import (
    BF16_ROW,
    REFERENCE,
    VARIANTS,
    UnknownVariant,
    built_by,
    directories,
    spec,
    with_directories,
)
from pipeline.runtimes.record import VariantInfo


def test_names_are_unique_and_reference_rows_have_no_directory():
    names = [v.name for v in VARIANTS]
    assert len(names) == len(set(names))
    assert not spec(REFERENCE).has_directory and not spec(BF16_ROW).has_directory
    assert REFERENCE not in {v.name for v in with_directories()}


def test_kinds_come_from_the_table_not_the_name():
    assert spec("int8-pruned").family == "pruned" and spec("int8-pruned").cpu_int8
    assert spec("tensorrt-int8").quantized and not spec("tensorrt-int8").cpu_int8
    assert {v.name for v in VARIANTS if v.cpu_int8} == {"int8-dynamic", "int8-static", "int8-qat", "int8-openvino",
                                                      "int8-qat-openvino", "int8-pruned", "int8-distilled",
                                                      "int8-distilled-openvino"}
    assert spec("fp32-distilled").family == spec("int8-distilled").family == "distilled"
    assert not spec("fp32-distilled").quantized and spec("fp32-distilled").servable
    assert [v.name for v in built_by("export")] == ["fp32-torchscript", "fp32-onnx"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownVariant, match="int8-static"):
        spec("int8-statik")


def test_records_take_format_dtype_and_file_from_the_registry(tmp_path):
    built = VariantInfo.built("int8-qat", {"k": 1})
    assert (built.format, built.dtype, built.file, built.status) == ("onnx", "int8", "model.onnx", "ok")
    skipped = VariantInfo.skipped("tensorrt-fp16", "no CUDA", {})
    assert (skipped.format, skipped.dtype, skipped.file, skipped.status) == ("tensorrt", "float16", None, "skipped")
    assert directories(tmp_path)["int8-static"] == tmp_path / "int8-static"
