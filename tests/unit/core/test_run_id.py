"""Unit: each `dvc repro` gets its own pipeline run id, shared by all the stages it runs, without `make`'s
`PIPELINE_RUN_ID`; a stage outside DVC gets the commit alone. A stand-in `dvc` script plays the repro."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.core.run_id import git_commit_id, is_dvc_command, pipeline_run_id
from tests.factories import ROOT

STAGE = f"{sys.executable} -c 'from pipeline.core.run_id import pipeline_run_id; print(pipeline_run_id())'"


def _repro(tmp_path, stages: int = 2) -> list[str]:
    """Run `stages` stand-in stages under a process named `dvc`, as `dvc repro` runs each stage's command."""
    dvc = tmp_path / "bin" / "dvc"
    dvc.parent.mkdir(exist_ok=True)
    dvc.write_text("#!/bin/sh\n" + "\n".join([STAGE] * stages) + "\n")
    dvc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_RUN_ID"} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(dvc), "repro"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_stages_of_one_repro_share_an_id_and_the_next_repro_has_another(tmp_path):
    first, second = _repro(tmp_path), _repro(tmp_path)
    assert len(set(first)) == 1 and len(set(second)) == 1
    assert first[0] != second[0]
    assert first[0].startswith(git_commit_id() + "-") and second[0].startswith(git_commit_id() + "-")


def test_make_runs_id_wins_and_a_stage_outside_dvc_gets_the_commit(monkeypatch):
    monkeypatch.setenv("PIPELINE_RUN_ID", "make-run-1")
    assert pipeline_run_id() == "make-run-1"
    monkeypatch.delenv("PIPELINE_RUN_ID")
    assert pipeline_run_id() == git_commit_id()  # pytest is no dvc process


def test_dvc_command_lines_are_recognised():
    assert is_dvc_command(["dvc", "repro"])
    assert is_dvc_command(["/repo/.venv/bin/python", "/repo/.venv/bin/dvc", "exp", "run"])
    assert is_dvc_command(["python", "-m", "dvc", "repro"])
    assert not is_dvc_command(["python", "-m", "pytest", "tests/dvc"])
    assert not is_dvc_command(["/bin/sh", "-c", "python -m stages.prepare"])
