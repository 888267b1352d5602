"""Unit: the hidden folders beside a batch-scoring output (`pipeline.deployment.batch_output`), no Spark: what a run
killed outright (SIGKILL) left is tidied by the next run on the same host, and nothing of a live run or of another
host is touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.deployment.batch_output import (
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
    recover_abandoned,
    run_tag,
    staged_output,
)


def dead_pid() -> int:
    """The process id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def folder(parent: Path, name: str, files: dict[str, str]) -> Path:
    parent.joinpath(name).mkdir()
    for rel, text in files.items():
        (parent / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (parent / name / rel).write_text(text)
    return parent / name


def test_a_killed_runs_staging_is_deleted_and_a_live_or_other_hosts_is_left(tmp_path):
    out = tmp_path / "scored"
    folder(tmp_path, "scored", {"part-0.parquet": "earlier answers"})
    dead = folder(tmp_path, f".scored{STAGING_SUFFIX}{run_tag(dead_pid())}", {"scored/part-0.parquet": "partial"})
    live = folder(tmp_path, f".scored{STAGING_SUFFIX}{run_tag(1)}", {"x": "a live process's (pid 1)"})
    other = folder(tmp_path, f".scored{STAGING_SUFFIX}elsewhere.example-{dead_pid()}", {"x": "another host's"})
    unrelated = folder(tmp_path, f".scored-notes{STAGING_SUFFIX}{run_tag(dead_pid())}", {"x": "another output's"})

    said = recover_abandoned(str(out), local_master=True)

    assert not dead.exists() and live.exists() and other.exists() and unrelated.exists()
    assert said == [f"deleted {dead.name}, the staging folder of a run on this host that was killed (process "
                    f"{dead.name.rsplit('-', 1)[1]} is gone)"]
    assert (out / "part-0.parquet").read_text() == "earlier answers"
    assert recover_abandoned(str(out), local_master=True) == []  # nothing left to do


def test_an_earlier_output_moved_aside_by_a_killed_swap_is_put_back(tmp_path):
    """Killed between the swap's two renames: OUTPUT is missing and its earlier answers sit in the hidden folder, the
    only copy; they are put back (and the staging beside them, the new answers never committed, deleted)."""
    out = tmp_path / "scored"
    pid = dead_pid()
    aside = folder(tmp_path, f".scored{REPLACED_SUFFIX}{run_tag(pid)}", {"part-0.parquet": "earlier answers"})
    staging = folder(tmp_path, f".scored{STAGING_SUFFIX}{run_tag(pid)}", {"scored/part-0.parquet": "new answers"})

    said = recover_abandoned(str(out), local_master=True)

    assert (out / "part-0.parquet").read_text() == "earlier answers"
    assert not aside.exists() and not staging.exists()
    assert said[0].startswith(f"put back {out}: a run killed during its swap (process {pid})")
    assert len(said) == 2


def test_an_earlier_output_left_after_a_finished_swap_is_deleted(tmp_path):
    out = tmp_path / "scored"
    folder(tmp_path, "scored", {"part-0.parquet": "new answers"})
    aside = folder(tmp_path, f".scored{REPLACED_SUFFIX}{run_tag(dead_pid())}", {"part-0.parquet": "earlier"})
    said = recover_abandoned(str(out), local_master=True)
    assert not aside.exists() and (out / "part-0.parquet").read_text() == "new answers"
    assert said and "earlier output, already replaced," in said[0]


def test_the_staging_folder_is_named_for_this_host_and_process(tmp_path):
    staged = staged_output(str(tmp_path / "scored"), local_master=True)
    assert staged is not None and staged.holder.name == f".scored{STAGING_SUFFIX}{run_tag()}"
    assert staged.folder == staged.holder / "scored"
    assert recover_abandoned("hdfs://cluster/scored", local_master=True) == []  # written in place: nothing to tidy
