"""Unit: the quantize stage's intermediate models live beside the variants (`scratch_directory`), so the chosen
int8-static model is renamed into its variant directory within one filesystem, never across from the system
temporary directory (a tmpfs, where the rename fails with EXDEV)."""

from __future__ import annotations

import os
import tempfile

from pipeline.variants.quantize import scratch_directory


def test_the_scratch_directory_is_inside_the_variants_root_and_removed_after(tmp_path, monkeypatch):
    elsewhere = tmp_path / "system-tmp"
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))  # the system temporary directory is not used
    root = tmp_path / "models" / "variants"  # not made yet: the stage's first run
    with scratch_directory(root, "quantize") as tmp:
        assert tmp.parent == root and tmp.name.startswith(".quantize-") and tmp.is_dir()
        destination = root / "int8-static"
        destination.mkdir()
        assert os.stat(tmp).st_dev == os.stat(destination).st_dev
        (tmp / "static-minmax.onnx").write_bytes(b"model")
        (tmp / "static-minmax.onnx").replace(destination / "model.onnx")  # what `_build_static` does
        assert (destination / "model.onnx").read_bytes() == b"model"
    assert not tmp.exists() and not list(elsewhere.iterdir())
    assert sorted(p.name for p in root.iterdir()) == ["int8-static"]
