"""Unit: which pipeline execution a stage belongs to (`pipeline.core.run_id.pipeline_run_id`), read from the
environment the stage was started with: `PIPELINE_RUN_ID` (make run) wins, each `dvc exp run` gets its own id from
what DVC sets for its stage commands, and a bare `dvc repro` or a stage run by hand gets the commit alone, with a
warning. No process tree is walked, and nothing run-specific is in `dvc.yaml` (DVC's cache stays untouched)."""

from __future__ import annotations

import ast
import logging

import yaml

from pipeline.core.run_id import git_commit, pipeline_run_id
from tests.factories import ROOT

#: What DVC gives every stage command of a bare `dvc repro` (`dvc/stage/run.py`): nothing names the execution.
BARE_REPRO = {"DVC_ROOT": str(ROOT), "DVC_STAGE": "prepare"}


def test_make_runs_id_wins_over_everything_dvc_sets():
    env = {"PIPELINE_RUN_ID": "make-run-1", "DVC_EXP_NAME": "sunny-lake", "DVC_EXP_BASELINE_REV": "a" * 40}
    assert pipeline_run_id(env) == "make-run-1"
    assert pipeline_run_id({**BARE_REPRO, "PIPELINE_RUN_ID": "make-run-1"}) == "make-run-1"


def test_the_stages_of_one_dvc_exp_run_share_an_id_and_the_next_experiment_has_another():
    baseline = "0123456789abcdef" * 2 + "01234567"
    first = [pipeline_run_id({**BARE_REPRO, "DVC_STAGE": stage, "DVC_EXP_NAME": "sunny-lake",
                              "DVC_EXP_BASELINE_REV": baseline}) for stage in ("prepare", "finetune")]
    second = pipeline_run_id({**BARE_REPRO, "DVC_EXP_NAME": "quiet-fern", "DVC_EXP_BASELINE_REV": baseline})
    assert first == ["exp-sunny-lake-0123456789ab"] * 2
    assert second == "exp-quiet-fern-0123456789ab"


def test_a_bare_repro_or_a_stage_by_hand_gets_the_commit_alone_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.core.run_id"):
        by_stage = {pipeline_run_id({**BARE_REPRO, "DVC_STAGE": s}) for s in ("prepare", "finetune", "package")}
        by_hand = pipeline_run_id({})
    assert by_stage == {git_commit(short=True)} and by_hand == git_commit(short=True)
    assert not git_commit(short=True).endswith("-dirty")  # a repro rewrites dvc.lock between its stages: no split
    warnings = [r.getMessage() for r in caplog.records if r.name == "pipeline.core.run_id"]
    assert len(warnings) == 4 and all("PIPELINE_RUN_ID is not set" in w for w in warnings)


def test_no_module_of_the_pipeline_walks_the_process_tree():
    """The run id comes from the environment alone: nothing under pipeline/ imports psutil (MLflow's system
    metrics still use it, which is why pyproject keeps it)."""
    importers = []
    for path in (ROOT / "pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            importers += [str(path.relative_to(ROOT)) for n in names if n.split(".")[0] == "psutil"]
    assert importers == []


def test_nothing_run_specific_is_in_a_stage_command_params_or_deps():
    """The run id reaches a stage through its environment only, so DVC's stage hashes do not change per run.
    (Code deps are module files, `pipeline/core/run_id.py` among them: a fixed path, left out of the check.)"""
    from pipeline.core.stage_deps import is_code_dep

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        deps = [d for d in stage.get("deps", []) if not is_code_dep(str(d))]
        text = yaml.safe_dump({"cmd": stage.get("cmd"), "params": stage.get("params"), "deps": deps})
        for word in ("PIPELINE_RUN_ID", "DVC_EXP_NAME", "run_id", "$("):
            assert word not in text, (name, word)


def test_a_run_id_that_would_break_the_parent_runs_search_filter_is_refused():
    """The id is matched inside MLflow's filter string: a quote would end it (an unclear MLflow error, or a filter
    that means something else)."""
    import pytest

    for bad in ("it's-mine", "a b", "x" * 201, "semi;colon"):
        with pytest.raises(ValueError, match="PIPELINE_RUN_ID gives the run id"):
            pipeline_run_id({**BARE_REPRO, "PIPELINE_RUN_ID": bad})
    with pytest.raises(ValueError, match="DVC_EXP_NAME"):
        pipeline_run_id({**BARE_REPRO, "DVC_EXP_NAME": "o'brien"})
    assert pipeline_run_id({**BARE_REPRO, "PIPELINE_RUN_ID": "20261127T160000Z-cd12c0d"}) == "20261127T160000Z-cd12c0d"
