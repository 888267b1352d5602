"""Which pipeline execution a stage process belongs to (`pipeline_run_id`), so that the stages of one execution
share one MLflow parent run and two executions never do.

`make run` sets `PIPELINE_RUN_ID` once for the whole run. Under a bare `dvc repro` (or `dvc exp run`) the id is the
git commit (plus `-dirty` for uncommitted changes) and the identity of the `dvc` process that runs the stages, its
start time and process id: every stage of that repro finds the same ancestor, the next repro is another process.
Nothing of it reaches a stage's command or params, so DVC's cache is untouched. A stage run by hand, outside DVC,
gets the commit alone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def pipeline_run_id() -> str:
    """Identifier shared by all stages of one pipeline execution (see the module docstring)."""
    explicit = os.environ.get("PIPELINE_RUN_ID")
    if explicit:
        return explicit
    commit = git_commit_id()
    repro = repro_process()
    if repro is None:
        return commit
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(repro.create_time()))
    return f"{commit}-{started}-{repro.pid}"


def git_commit_id() -> str:
    """The short commit, `-dirty` when tracked files have uncommitted changes, `no-git` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "no-git"


def git_commit() -> str:
    """The current commit, or 'unknown' outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def is_dvc_command(cmdline: list[str]) -> bool:
    """A `dvc` command line: the `dvc` executable or script (`dvc repro`, `python .../bin/dvc exp run`) or
    `python -m dvc`."""
    head = cmdline[:3]
    return any(Path(part).name == "dvc" for part in head[:2]) or head[1:3] == ["-m", "dvc"]


def repro_process() -> Any:
    """The nearest ancestor `dvc` process of this one (a `psutil.Process`), or None when there is none."""
    import psutil

    try:
        parents = psutil.Process().parents()
    except psutil.Error:
        return None
    for parent in parents:
        try:
            if is_dvc_command(parent.cmdline()):
                return parent
        except psutil.Error:  # a parent that exited or that we may not read
            continue
    return None
