"""Unit: variant directories describe themselves; missing or corrupt inputs name the file."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.modeling import ModelSourceError, load_finetuned
from pipeline.runtimes.record import VariantError, read_variant
from pipeline.runtimes.registry import load_runner


def test_variant_directories_describe_themselves(built):
    assert len(built["dirs"]) == 9
    for name, d in built["dirs"].items():
        info = json.loads((d / "variant.json").read_text())
        assert info["name"] == name and {"format", "dtype", "params", "status"} <= set(info)
        assert (d / "tokenizer.json").is_file() and (d / "pipeline.json").is_file()


def test_missing_or_corrupt_inputs_name_the_file(tmp_path, tiny_model_dir, built):
    with pytest.raises(ModelSourceError, match=r"missing: .*config\.json"):
        load_finetuned(tmp_path)
    (tmp_path / "variant.json").write_text("{not json")
    with pytest.raises(VariantError, match=re.escape(str(tmp_path / "variant.json"))):
        read_variant(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"garbage")
    (broken / "variant.json").write_text(json.dumps({"name": "x", "format": "onnx", "dtype": "int8",
                                                     "file": "model.onnx"}))
    with pytest.raises(VariantError, match="cannot load"):
        load_runner(broken)
