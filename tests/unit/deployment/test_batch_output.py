"""Unit: the hidden folders beside a batch-scoring output (`pipeline.deployment.batch_output`), no Spark: what a run
killed outright (SIGKILL) left is tidied by the next run, judged by the process identity its staging folder records
(`pipeline.core.process_identity`), and nothing of a live run, another host's, or one that names no owner is
touched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.core import process_identity
from pipeline.deployment.batch_output import (
    OWNER_FILE,
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


def staging(parent: Path, output: str, tag: str, owner: dict[str, str] | None) -> Path:
    """A staging folder as a run leaves it: Spark's part files, and its owner's identity unless None."""
    files = {f"{output}/part-0.parquet": "partial"}
    if owner is not None:
        files[OWNER_FILE] = json.dumps(owner)
    return folder(parent, f".{output}{STAGING_SUFFIX}{tag}", files)


def identity(**changes: str) -> dict[str, str]:
    """This process's identity with `changes` (another pid: a process of this machine that has ended)."""
    return {**process_identity.current(), **changes}


def test_a_killed_runs_staging_is_deleted_and_a_live_other_hosts_or_ownerless_one_is_left(tmp_path):
    out = tmp_path / "scored"
    folder(tmp_path, "scored", {"part-0.parquet": "earlier answers"})
    pid = str(dead_pid())
    dead = staging(tmp_path, "scored", f"h-{pid}", identity(**{process_identity.PID_TAG: pid}))
    live = staging(tmp_path, "scored", "h-1", identity())  # this very process: alive
    other = staging(tmp_path, "scored", "elsewhere-2",
                    identity(**{process_identity.HOST_TAG: "elsewhere.example", process_identity.PID_TAG: pid}))
    ownerless = staging(tmp_path, "scored", f"h-{pid}0", None)
    unrelated = staging(tmp_path, "scored-notes", f"h-{pid}", identity(**{process_identity.PID_TAG: pid}))

    said = recover_abandoned(str(out), local_master=True)

    assert not dead.exists() and live.exists() and other.exists() and ownerless.exists() and unrelated.exists()
    assert said == [f"deleted {dead.name}, the staging folder of a run that was killed (process {pid} is gone)"]
    assert (out / "part-0.parquet").read_text() == "earlier answers"
    assert recover_abandoned(str(out), local_master=True) == []  # nothing left to do


def test_an_earlier_output_moved_aside_by_a_killed_swap_is_put_back(tmp_path):
    """Killed between the swap's two renames: OUTPUT is missing and its earlier answers sit in the hidden folder, the
    only copy; they are put back, and the staging folder (the new answers never committed) deleted."""
    out = tmp_path / "scored"
    pid = str(dead_pid())
    aside = folder(tmp_path, f".scored{REPLACED_SUFFIX}h-{pid}", {"part-0.parquet": "earlier answers"})
    holder = staging(tmp_path, "scored", f"h-{pid}", identity(**{process_identity.PID_TAG: pid}))

    said = recover_abandoned(str(out), local_master=True)

    assert (out / "part-0.parquet").read_text() == "earlier answers"
    assert not aside.exists() and not holder.exists()
    assert said[0].startswith(f"put back {out}: a run killed during its swap (process {pid})") and len(said) == 2


def test_an_earlier_output_left_after_a_finished_swap_is_deleted(tmp_path):
    out = tmp_path / "scored"
    folder(tmp_path, "scored", {"part-0.parquet": "new answers"})
    pid = str(dead_pid())
    aside = folder(tmp_path, f".scored{REPLACED_SUFFIX}h-{pid}", {"part-0.parquet": "earlier"})
    staging(tmp_path, "scored", f"h-{pid}", identity(**{process_identity.PID_TAG: pid}))
    said = recover_abandoned(str(out), local_master=True)
    assert not aside.exists() and (out / "part-0.parquet").read_text() == "new answers"
    assert said and "the earlier output a killed run" in said[0]


def test_the_staging_folder_is_named_for_this_host_and_process_and_records_its_owner(tmp_path):
    staged = staged_output(str(tmp_path / "scored"), local_master=True)
    assert staged is not None and staged.holder.name == f".scored{STAGING_SUFFIX}{run_tag()}"
    assert staged.folder == staged.holder / "scored"
    staged.claim()
    assert json.loads((staged.holder / OWNER_FILE).read_text()) == process_identity.current()
    assert recover_abandoned(str(tmp_path / "scored"), local_master=True) == []  # its owner runs: left alone
    assert staged.holder.exists()
    assert recover_abandoned("hdfs://cluster/scored", local_master=True) == []  # written in place: nothing to tidy
