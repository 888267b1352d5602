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


def test_what_a_killed_run_left_is_removed_before_the_next_one_starts(tmp_path):
    """SIGKILL runs no cleanup: the next run of the stage removes its leftover scratch directories (and only the
    stage's own: another stage's scratch and the variants stay)."""
    root = tmp_path / "variants"
    leftover = root / ".quantize-abc123"
    leftover.mkdir(parents=True)
    (leftover / "fused.onnx").write_bytes(b"half a model")
    other = root / ".prune-xyz"
    other.mkdir()
    (root / "int8-static").mkdir()
    with scratch_directory(root, "quantize") as tmp:
        assert not leftover.exists() and tmp.is_dir()
    assert sorted(p.name for p in root.iterdir()) == [".prune-xyz", "int8-static"]
