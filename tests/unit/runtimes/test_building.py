"""Unit: a variant directory is built aside and replaces the old one whole (`record.building`): a build that fails
or is killed leaves the previous directory as it was, and what it left behind is hidden and removed next time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.core.io import stale_builds
from pipeline.runtimes.catalog import directories
from pipeline.runtimes.record import (
    VARIANT_FILE,
    VariantError,
    VariantInfo,
    building,
    read_variant,
    write_skipped,
    write_variant,
)

NAME = "tensorrt-fp16"  # a registry variant whose record needs no model file to be read back (no batching check)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The files `write_variant` copies beside a model: a tokenizer and the preprocessing record."""
    d = tmp_path / "finetuned"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"new": true}')
    (d / "pipeline.json").write_text('{"preprocessing": {}}')
    return d


@pytest.fixture
def previous(tmp_path: Path, model_dir: Path) -> Path:
    """A variant directory from an earlier build: its engine, record and a file only that version had."""
    final = tmp_path / "variants" / NAME
    with building(final) as work:
        (work / "model.engine").write_bytes(b"old engine")
        (work / "only-in-the-old-version.txt").write_text("stale")
        write_variant(work, VariantInfo.built(NAME, {"version": "old"}), model_dir)
    return final


def test_a_build_that_raises_leaves_the_previous_directory_exactly_as_it_was(previous, model_dir):
    before = snapshot(previous)
    with pytest.raises(RuntimeError, match="parity failed"), building(previous) as work:
        assert work.parent == previous.parent and work.name.startswith(f".{NAME}.building-")
        (work / "model.engine").write_bytes(b"half a new engine")
        raise RuntimeError("parity failed")
    assert snapshot(previous) == before
    assert read_variant(previous).params == {"version": "old"}
    assert siblings(previous.parent) == [NAME]  # the build directory is gone


def test_a_block_that_writes_no_record_is_refused_and_changes_nothing(previous):
    before = snapshot(previous)
    with pytest.raises(VariantError, match=f"wrote no {VARIANT_FILE}"), building(previous) as work:
        (work / "model.engine").write_bytes(b"an engine nothing describes")
    assert snapshot(previous) == before and siblings(previous.parent) == [NAME]


def test_a_successful_build_replaces_the_whole_directory(previous, model_dir):
    with building(previous) as work:
        (work / "model.engine").write_bytes(b"new engine")
        write_variant(work, VariantInfo.built(NAME, {"version": "new"}), model_dir)
        assert read_variant(previous).params == {"version": "old"}  # nothing published before the block ends
    assert (previous / "model.engine").read_bytes() == b"new engine"
    assert read_variant(previous).params == {"version": "new"}
    assert not (previous / "only-in-the-old-version.txt").exists()
    assert (previous / "tokenizer.json").read_text() == '{"new": true}'
    assert siblings(previous.parent) == [NAME]  # neither the build nor the old version is left beside it


def test_a_first_build_creates_the_directory_and_its_parents(tmp_path, model_dir):
    final = tmp_path / "not" / "made" / NAME
    with building(final) as work:
        write_variant(work, VariantInfo.skipped(NAME, "no CUDA device visible", {}), model_dir)
    assert read_variant(final).status == "skipped" and siblings(final.parent) == [NAME]


def test_a_skip_record_replaces_an_earlier_build_with_its_model_file(previous, model_dir):
    """A variant skipped now must not keep the model file of the build before it beside the record saying none."""
    write_skipped(previous, VariantInfo.skipped(NAME, "no CUDA device visible", {}), model_dir)
    info = read_variant(previous)
    assert info.status == "skipped" and info.file is None
    assert sorted(p.name for p in previous.iterdir()) == ["pipeline.json", "tokenizer.json", VARIANT_FILE]


def test_a_killed_build_leaves_the_previous_directory_and_a_hidden_leftover_the_next_build_removes(previous,
                                                                                                     model_dir):
    """A process killed (SIGKILL: no cleanup runs) after writing its model file and before its record leaves the
    old directory whole; its build directory is hidden, absent from the variant listing, and removed when the
    variant is built next."""
    before = snapshot(previous)
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from pipeline.runtimes.record import building
        with building(Path({str(previous)!r})) as work:
            (work / "model.engine").write_bytes(b"half a new engine")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    killed = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[3])
    assert killed.wait(timeout=60) == -signal.SIGKILL
    root = previous.parent
    assert snapshot(previous) == before
    (leftover,) = stale_builds(previous)
    assert leftover.name == f".{NAME}.building-{killed.pid}"
    assert (leftover / "model.engine").read_bytes() == b"half a new engine"
    assert leftover not in directories(root).values() and all(not p.name.startswith(".")
                                                               for p in directories(root).values())
    with building(previous) as work:
        assert not leftover.exists()  # removed before the new build starts
        write_variant(work, VariantInfo.built(NAME, {"version": "new"}), model_dir)
    assert siblings(root) == [NAME] and read_variant(previous).params == {"version": "new"}


def test_leftovers_of_another_variant_or_the_swap_are_told_apart(tmp_path, model_dir):
    """`stale_builds` finds a variant's own leftovers (a build, or an old version mid-swap) and no other
    variant's; each is hidden from the listing and removed by the next build of its variant only."""
    root = tmp_path / "variants"
    mine = [root / f".{NAME}.building-123", root / f".{NAME}.replaced-123"]
    other = root / ".tensorrt-int8.building-123"
    for d in (*mine, other):
        d.mkdir(parents=True)
        (d / VARIANT_FILE).write_text("{}")  # a complete-looking record does not make it a variant
    assert stale_builds(root / NAME) == sorted(mine)
    assert not {*mine, other} & set(directories(root).values())
    with building(root / NAME) as work:
        write_variant(work, VariantInfo.skipped(NAME, "no CUDA device visible", {}), model_dir)
    assert siblings(root) == [other.name, NAME]


def test_the_build_directory_is_on_the_final_directory_s_filesystem(tmp_path):
    """Builders rename intermediate files into it, and it is renamed into place: both need one filesystem."""
    final = tmp_path / "variants" / NAME
    with pytest.raises(VariantError), building(final) as work:
        assert os.stat(work).st_dev == os.stat(final.parent).st_dev


def test_a_model_save_that_fails_midway_leaves_the_previous_model_directory(tmp_path):
    """`loop.save_model` (finetune's and distill's HF directories) goes through the same swap: a failure after the
    weights are written leaves the previous directory and its `pipeline.json` as they were; a save that completes
    replaces the directory whole, record included."""
    import json

    import transformers

    from pipeline.core.params import DataParams, ModelParams, TrainParams
    from pipeline.training import loop

    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    model_dir = tmp_path / "finetuned"
    model_dir.mkdir()
    (model_dir / "pipeline.json").write_text('{"old": true}')
    (model_dir / "stale.bin").write_bytes(b"old")

    class Tokenizer:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def save_pretrained(self, directory: Path) -> None:
            if self.fails:
                raise OSError("disk full while writing the tokenizer")
            (directory / "tokenizer.json").write_text("{}")

    with pytest.raises(OSError, match="disk full"):
        loop.save_model(model, Tokenizer(fails=True), model_dir, DataParams(), ModelParams(), TrainParams())
    assert sorted(p.name for p in model_dir.iterdir()) == ["pipeline.json", "stale.bin"]
    assert (model_dir / "pipeline.json").read_text() == '{"old": true}'
    assert not list(tmp_path.glob(".finetuned.*"))

    loop.save_model(model, Tokenizer(fails=False), model_dir, DataParams(), ModelParams(), TrainParams())
    assert json.loads((model_dir / "pipeline.json").read_text())["labels"] == {"0": "LABEL_0", "1": "LABEL_1"}
    assert (model_dir / "model.safetensors").is_file() and not (model_dir / "stale.bin").exists()
    assert not list(tmp_path.glob(".finetuned.*"))
