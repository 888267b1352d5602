"""Which pipeline execution a stage process belongs to (`pipeline_run_id`), so that the stages of one execution
share one MLflow parent run and two executions do not. A stage reads it once, where it starts
(`pipeline.core.stage`), from the environment it was started with, and passes it down from there.

The rule, first match wins:

1. `PIPELINE_RUN_ID`: `make run` sets it once for the whole run (its start time and commit). Whoever runs DVC by
   hand can do the same: `PIPELINE_RUN_ID=$(date -u +%Y%m%dT%H%M%SZ) dvc repro`.
2. `dvc exp run`: DVC gives every stage command of one experiment `DVC_EXP_NAME` (a fresh random name for each
   experiment, unless `-n` names it) and `DVC_EXP_BASELINE_REV` (the commit it starts from); the id is
   `exp-<name>-<baseline>`. Reusing a name (`dvc exp run -n NAME --force`) reuses its parent run.
3. Otherwise, a bare `dvc repro` or a stage run by hand: the git commit alone, with a warning. DVC gives a stage
   command nothing else that tells one `dvc repro` from the next (`DVC_ROOT` names the repository, `DVC_STAGE`
   the stage; nothing names the execution), and finding the `dvc` process among the stage's ancestors (a walk
   of the process tree, what this module did before) is not done. The price: two bare `dvc repro` on one
   commit put their stage runs (each its own child run, with its own start time) under one parent run. The
   commit carries no `-dirty` mark, because a repro rewrites git-tracked files (`dvc.lock`, `metrics/`) between
   its stages and would otherwise split itself over two parents.

Nothing of it reaches a stage's command, params or deps in `dvc.yaml`, so DVC's cache is untouched."""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: Set by `make run` (or by hand): the execution's id, used as given.
RUN_ID_ENV = "PIPELINE_RUN_ID"
#: Set by DVC for every stage command of one `dvc exp run`: the experiment's name and its baseline commit.
EXP_NAME_ENV = "DVC_EXP_NAME"
EXP_BASELINE_ENV = "DVC_EXP_BASELINE_REV"
#: What a run id may hold: it is matched inside an MLflow search filter (`tags.pipeline.run_id = '<id>'`), where a
#: quote would end the string and other characters would need escaping that MLflow's filter grammar lacks.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._:+@-]{1,200}")


def pipeline_run_id(environ: Mapping[str, str]) -> str:
    """The id shared by all stages of one pipeline execution, from the environment `environ` a stage was started
    with (the rule is the module docstring's); reads the git commit only when neither variable is set."""
    explicit = environ.get(RUN_ID_ENV)
    if explicit:
        return checked_run_id(explicit, RUN_ID_ENV)
    experiment = environ.get(EXP_NAME_ENV)
    if experiment:
        baseline = environ.get(EXP_BASELINE_ENV, "")[:12]
        return checked_run_id(f"exp-{experiment}-{baseline}" if baseline else f"exp-{experiment}", EXP_NAME_ENV)
    commit = git_commit(short=True)
    log.warning("%s is not set (make run sets it; so can you: %s=<id> dvc repro): this stage's MLflow parent run is "
                "the one of commit %s, shared with every other execution on that commit", RUN_ID_ENV, RUN_ID_ENV,
                commit)
    return commit


def checked_run_id(run_id: str, source: str) -> str:
    """`run_id` when it matches `RUN_ID_PATTERN`; else a ValueError naming the variable it came from."""
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(f"{source} gives the run id {run_id[:60]!r}: use 1-200 letters, digits and . _ : + @ -")
    return run_id


def git_commit(*, short: bool = False) -> str:
    """HEAD's commit (`short`: its first 12 hex digits, the run id's form), `no-git` outside git."""
    try:
        return subprocess.run(["git", "rev-parse", *(["--short=12"] if short else []), "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no-git"
