"""`pipeline.core.io`: files are written whole or not at all. A writer that fails (or is killed) mid-write leaves
the previous file, or none, for the next reader: never a part of a file that a later stage or a server trusts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pipeline.core import io
from pipeline.core.io import read_json, read_predictions, replaced_on_success, write_json, write_predictions
from tests.factories import ROOT


def test_a_write_that_fails_leaves_the_previous_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "metrics" / "variants.json"
    write_json(path, {"accuracy": 0.9})
    with pytest.raises(RuntimeError), replaced_on_success(path) as tmp:
        tmp.write_text('{"accuracy": 0.')  # half a file, then the writer fails
        raise RuntimeError("the stage broke mid-write")
    assert read_json(path) == {"accuracy": 0.9}
    assert sorted(p.name for p in path.parent.iterdir()) == ["variants.json"]


def test_a_writer_killed_mid_write_leaves_the_previous_file_whole(tmp_path):
    """SIGKILL while the new content is half written: the reader finds the old JSON (a plain `write_text` would
    have left it truncated)."""
    path = tmp_path / "benchmark.json"
    write_json(path, {"rows": list(range(10))})
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from pipeline.core.io import replaced_on_success
        with replaced_on_success(Path({str(path)!r})) as tmp, tmp.open("w") as out:
            out.write('{{"rows": [0, 1, 2')
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert read_json(path) == {"rows": list(range(10))}
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "benchmark.json"]
    # the killed writer's temporary file stays (hidden, never read as the file) until the next write of the file,
    # which removes it: in a folder that is no DVC output (plots uploaded to MLflow) nothing else would
    assert leftovers and all(name.startswith(".benchmark.json.") and name.endswith(".tmp") for name in leftovers)
    write_json(path, {"rows": [1]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmark.json"]


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    """Only a dead writer's temporary file is removed: another process writing the same file now keeps its own."""
    path = tmp_path / "a.json"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = tmp_path / f".a.json.{live.pid}@{io.writer_tag().split('@')[1]}.tmp"
        theirs.write_text("{")
        write_json(path, {"x": 1})
        assert theirs.exists() and read_json(path) == {"x": 1}
    finally:
        live.kill()
        live.wait()
    write_json(path, {"x": 2})
    assert not theirs.exists()


@pytest.mark.parametrize("stray", ["99999999999999999999@{here}", "\u00b2@{here}", "x@{here}", "1@0123456789ab", "1"])
def test_a_stray_file_named_like_a_temporary_one_never_fails_the_write(tmp_path, stray):
    """A name that only looks like a killed writer's (an over-long or non-ASCII "pid"), and a writer's of another
    host, boot or container (whose process ids mean nothing here), are left alone, and the file is written."""
    stray = f".a.json.{stray.format(here=io.writer_tag().split('@')[1])}.tmp"
    (tmp_path / stray).write_text("")
    write_json(tmp_path / "a.json", {"x": 1})
    assert read_json(tmp_path / "a.json") == {"x": 1} and (tmp_path / stray).exists()


def test_a_replaced_file_and_its_folder_are_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    """The new file's data reaches the disk before the rename and the folder's entry after it, so a machine crash
    cannot leave the name on an empty file; a swapped directory syncs every file in it and its parent."""
    synced = []
    monkeypatch.setattr(io, "synced", lambda p: synced.append(p))
    path = tmp_path / "m.json"
    write_json(path, {"x": 1})
    assert [p.name for p in synced] == [f".m.json.{io.writer_tag()}.tmp", tmp_path.name]
    synced.clear()
    final = tmp_path / "model"
    with io.directory_replaced_on_success(final, "record.json") as work:
        (work / "sub").mkdir()
        (work / "sub" / "w.bin").write_bytes(b"w")
        (work / "record.json").write_text("{}")
    names = [p.name for p in synced]
    assert {"w.bin", "sub", "record.json"} <= set(names) and names.index("w.bin") < names.index("sub")
    assert synced[-1] == tmp_path and (final / "sub" / "w.bin").read_bytes() == b"w"


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, OSError])
def test_a_directory_swap_stopped_between_its_two_renames_puts_the_previous_version_back(tmp_path, monkeypatch,
                                                                                         stop):
    """The old directory goes aside, then the new one into place: Ctrl-C, SIGTERM (`SystemExit`, as stages turn it)
    or a failed rename in between leaves the previous version whole where readers look, and no hidden leftovers."""
    final = tmp_path / "variants" / "int8-openvino"
    final.mkdir(parents=True)
    (final / "record.json").write_text('{"version": 1}')
    real, renames = os.replace, []

    def second_rename_stopped(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise stop()
        real(src, dst)

    monkeypatch.setattr(io.os, "replace", second_rename_stopped)
    with pytest.raises(stop), io.directory_replaced_on_success(final, "record.json") as work:
        (work / "record.json").write_text('{"version": 2}')
    assert len(renames) >= 2 and renames[0] == (final, renames[0][1])
    assert read_json(final / "record.json") == {"version": 1}
    assert sorted(p.name for p in final.parent.iterdir()) == ["int8-openvino"]


def test_written_json_and_predictions_read_back(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": [1.5, "x"]})
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": [1.5, "x"], "b": 1}
    seqs = [np.array([101, 7, 102]), np.array([101, 102])]
    write_predictions(tmp_path / "p.npz", np.ones((2, 2)), np.array([0, 1]), seqs, split="test")
    logits, meta = read_predictions(tmp_path / "p.npz", seqs, np.array([0, 1]))
    assert logits.shape == (2, 2) and meta == {"split": "test"}
    assert sorted(os.listdir(tmp_path)) == ["a.json", "p.npz"]


def test_a_figure_is_saved_whole_in_its_suffixs_format_or_not_at_all(tmp_path):
    """`save_figure` writes beside the file and renames (the temporary name's suffix is not the format's): a PNG
    where `.png` is asked, and a figure that fails to render leaves the previous file as it was, nothing beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "chart.png"
    io.save_figure(fig, path)
    assert path.read_bytes().startswith(b"\x89PNG")

    class Broken:
        def savefig(self, *args, **kwargs):
            args[0].write_bytes(b"half")
            raise RuntimeError("renderer failed")

    with pytest.raises(RuntimeError):
        io.save_figure(Broken(), path)
    assert path.read_bytes().startswith(b"\x89PNG") and [p.name for p in tmp_path.iterdir()] == ["chart.png"]
    plt.close(fig)
