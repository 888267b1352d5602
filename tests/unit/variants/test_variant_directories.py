"""Unit: the stages' builders write a variant aside and replace its directory whole (`record.building`): an export
that fails after writing its model file leaves the previous variants as they were, one that succeeds or records a
skip leaves nothing of the version before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.params import ExportParams, Params, PruneParams
from pipeline.runtimes.record import VARIANT_FILE, read_variant
from pipeline.variants.export import ExportError, Parity, run_export
from tests.factories import weight_format_here, write_tokenized


def earlier_build(root: Path, name: str, model_file: str) -> Path:
    """A variant directory as an earlier build left it: a model file, a record and a file only it had."""
    d = root / name
    d.mkdir(parents=True)
    (d / model_file).write_bytes(b"old model")
    (d / VARIANT_FILE).write_text('{"old": true}')
    (d / "only-in-the-old-version.txt").write_text("stale")
    return d


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_export_failing_after_its_model_file_is_written_leaves_the_previous_variants(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    """The parity check runs on the written file; when it fails, the previous variant (record and model) is still
    what the directory holds, and the half-built one is gone."""
    import pipeline.variants.export as build

    root = tmp_path / "variants"
    old = {name: earlier_build(root, name, file) for name, file in (("fp32-torchscript", "model.pt"),
                                                                    ("fp32-onnx", "model.onnx"))}
    before = {name: snapshot(d) for name, d in old.items()}
    written: list[Path] = []

    def failing_parity(batch: object, candidate: object) -> Parity:
        written.extend(root.glob(".fp32-torchscript.building-*/model.pt"))
        return Parity(max_abs_diff=1.0, label_agreement=0.5, batch=1)

    monkeypatch.setattr(build.ReferenceBatch, "parity", failing_parity)
    with pytest.raises(ExportError, match="parity failed"):
        run_export(finetuned=tiny_model_dir, tokenized=write_tokenized(tmp_path / "tok", {"test": 8}),
                   variants_root=root, params=ExportParams(parity_samples=4))
    assert len(written) == 1  # the new model file existed, aside, when the check ran
    assert {name: snapshot(d) for name, d in old.items()} == before
    assert sorted(p.name for p in root.iterdir()) == ["fp32-onnx", "fp32-torchscript"]


def test_an_export_replaces_the_previous_variants_whole(tmp_path, tiny_model_dir, monkeypatch, exported_as_built):
    """fp32-onnx is built aside (the old file stays published while the new one is checked) and replaces the old
    directory; fp32-torchscript, opted out, becomes a skip record with no model file of the build before it."""
    import pipeline.variants.export as build

    root = tmp_path / "variants"
    for name, file in (("fp32-torchscript", "model.pt"), ("fp32-onnx", "model.onnx")):
        earlier_build(root, name, file)
    checked: list[Path] = []

    class Runner(build.OrtRunner):
        def __init__(self, path: Path, *args: object, **kwargs: object) -> None:
            assert (root / "fp32-onnx" / "model.onnx").read_bytes() == b"old model"  # not yet replaced
            checked.append(Path(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(build, "OrtRunner", Runner)
    run_export(finetuned=tiny_model_dir, tokenized=write_tokenized(tmp_path / "tok", {"test": 8}),
               variants_root=root, params=ExportParams(parity_samples=4, torchscript=False))
    # checked as written and as served, both in the hidden build directory before it replaced the old one
    assert len(checked) == 2 and all(c.parent.name.startswith(".fp32-onnx.building-") for c in checked)
    onnx_dir, ts_dir = root / "fp32-onnx", root / "fp32-torchscript"
    assert read_variant(onnx_dir).status == "ok" and (onnx_dir / "model.onnx").read_bytes() != b"old model"
    assert read_variant(ts_dir).status == "skipped" and not (ts_dir / "model.pt").exists()
    for d in (onnx_dir, ts_dir):
        assert not (d / "only-in-the-old-version.txt").exists() and (d / "tokenizer.json").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["fp32-onnx", "fp32-torchscript"]


def test_a_disabled_prune_replaces_an_earlier_pruned_build_with_its_skip_record(tmp_path, tiny_model_dir,
                                                                                 tokenized_dir):
    from pipeline.variants.prune import run_prune

    out = earlier_build(tmp_path, "int8-pruned", "model.onnx")
    (tmp_path / ".int8-pruned.building-999").mkdir()  # a killed build's leftover
    run_prune(finetuned=tiny_model_dir, tokenized=tokenized_dir, variants_root=tmp_path,
              all_params=Params(prune=PruneParams(enabled=False)), weight_format=weight_format_here())
    info = read_variant(out)
    assert info.status == "skipped" and info.file is None
    assert not (out / "model.onnx").exists() and not (out / "only-in-the-old-version.txt").exists()
    assert not (tmp_path / ".int8-pruned.building-999").exists()
