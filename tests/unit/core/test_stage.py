"""Unit tests for the stage plumbing in `pipeline.core.stage`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.core.stage import StageContext

#: What `demo_stage` saw, for the test that runs it.
SEEN: dict[str, Any] = {}


def demo_stage(stage: StageContext, out: Annotated[Path, typer.Option(help="an output")]) -> None:
    """A stage body as `stages/*.py` write them: the context, then typed options."""
    SEEN.update(lr=stage.params.train.lr, out=out, auto=stage.auto.choices(), run_id=stage.run_id)


def test_a_stage_says_what_it_does_and_how_long_it_took(caplog, tmp_path, monkeypatch):
    import json

    import pytest

    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(tmp_path / "stages.jsonl"))

    from pipeline.core.params import ParamsError
    from pipeline.core.stage import run_stage

    with caplog.at_level(logging.INFO, logger="pipeline.stage"):
        run_stage(name="demo", body=lambda: None, run_id="unit-stage")
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.stage"]
    assert lines[0].startswith("==> demo: ") and lines[1].startswith("<== demo done in ")

    def bad() -> None:
        raise ParamsError("train.lr: must be > 0")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.stage"), pytest.raises(SystemExit) as stop:
        run_stage(name="demo", body=bad, run_id="unit-stage")
    assert stop.value.code == 2
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline.stage"][-1].startswith("<== demo failed in ")
    logged = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert [(e["run_id"], e["stage"], e["outcome"]) for e in logged] == [("unit-stage", "demo", "done"),
                                                                        ("unit-stage", "demo", "failed")]


def test_a_user_error_ends_the_stage_with_status_2_and_one_line(capsys):
    import pytest

    from pipeline.core.stage import run_stage
    from pipeline.runtimes.record import VariantError

    def body() -> None:
        raise VariantError("variant x was skipped: no GPU")

    with pytest.raises(SystemExit) as stopped:
        run_stage(name="evaluate", body=body, run_id="unit-stage")
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == "error: stage 'evaluate' failed: variant x was skipped: no GPU"


def test_a_programming_error_keeps_its_traceback():
    import pytest

    from pipeline.core.stage import run_stage

    def body() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_stage(name="evaluate", body=body, run_id="unit-stage")


def test_every_domain_error_of_a_stage_is_a_user_error():
    from pipeline.core.errors import UserError
    from pipeline.core.params import ParamsError
    from pipeline.data.imdb import DataSourceError, DataValidationError
    from pipeline.deployment.archive import PackageError
    from pipeline.modeling import ModelSourceError
    from pipeline.runtimes.record import VariantError
    from pipeline.surgery.errors import DistillError, PruneError
    from pipeline.training.classifier import AccelerationUnavailable
    from pipeline.variants.export import ExportError
    from pipeline.variants.onnx_int8 import QuantizeError

    for error in (DataSourceError, DataValidationError, PackageError, ModelSourceError, VariantError,
                  AccelerationUnavailable, DistillError, ExportError, QuantizeError, PruneError, ParamsError):
        assert issubclass(error, UserError), error


STAGES = ("prepare", "finetune", "export", "quantize", "prune", "distill", "tensorrt", "evaluate", "benchmark",
          "package")


def _stage_cli(name: str):
    import importlib

    from pipeline.core.stage import stage_command

    module = importlib.import_module(f"stages.{name}")
    return stage_command(name, getattr(module, name), module.__doc__)


def test_every_dvc_command_parses_into_its_stages_typed_options():
    """Each `dvc.yaml` command line is accepted by its stage's typed entry point, every option the stage requires
    is given there, and each value arrives as the annotated type (paths as `Path`)."""
    import shlex

    import yaml

    from tests.factories import ROOT

    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert set(dvc) == set(STAGES)
    for name in STAGES:
        argv = shlex.split(dvc[name]["cmd"])[3:]  # after `.venv/bin/python -m stages.<name>`
        command = _stage_cli(name)
        ctx = command.make_context(f"stages.{name}", list(argv))
        required = {p.name for p in command.params if p.required}
        assert required <= {k for k, v in ctx.params.items() if v is not None}, name
        assert all(isinstance(v, Path) for v in ctx.params.values() if v is not None), (name, ctx.params)
        assert ctx.params["params_file"] == Path("params.yaml")


def test_a_missing_option_is_a_usage_error_with_status_2(capsys):
    import pytest

    from pipeline.core.stage import stage_main
    from stages.quantize import quantize

    with pytest.raises(SystemExit) as stopped:
        stage_main("quantize", quantize, ["--finetuned", "models/finetuned"])
    assert stopped.value.code == 2
    assert "--tokenized" in capsys.readouterr().err


def test_the_body_gets_the_params_and_every_auto_resolved_once(tmp_path, monkeypatch):
    """`stage_main` loads the params file, resolves each `auto` setting once (here as an AVX2-only CPU would), reads
    the pipeline run id from the environment it was started with, and hands them to the body with its typed
    options; the body that logs nothing to MLflow never looks a parent run up (`StageContext.run_context` is
    resolved on first use)."""
    from pipeline.core import stage as stage_module
    from pipeline.core.settings import auto as auto_module
    from tests.factories import AVX2_ONLY_FLAGS

    monkeypatch.setenv("PIPELINE_CPU_FLAGS", AVX2_ONLY_FLAGS)
    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(tmp_path / "stages.jsonl"))
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-body")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n")
    calls = []
    resolve = auto_module.resolve_auto

    def counted(params, *args, **kwargs):
        calls.append(params)
        return resolve(params, *args, **kwargs)

    monkeypatch.setattr(auto_module, "resolve_auto", counted)
    monkeypatch.setattr("pipeline.core.params.resolve_auto", counted)
    SEEN.clear()
    stage_module.stage_main("demo", demo_stage, ["--params", str(tmp_path / "params.yaml"), "--out", "x/y"])
    assert len(calls) == 1
    assert SEEN["lr"] == 0.001 and SEEN["out"] == Path("x/y") and SEEN["run_id"] == "unit-body"
    assert not (tmp_path / "mlflow.db").exists()  # the params' store: never opened by a body that logs nothing
    import json

    assert [json.loads(line)["run_id"] for line in (tmp_path / "stages.jsonl").read_text().splitlines()] == [
        "unit-body"]
    assert {k: v["value"] for k, v in SEEN["auto"].items()} == {
        "train.precision": "32-true", "distill.enabled": False, "quantize.weight_format": "u8",
        "benchmark.bf16_row": False, "quantize.qat_precision": "32-true"}


def test_auto_settings_are_resolved_only_where_a_stage_starts():
    """No module of `pipeline/` calls a `resolve_*` rule of `pipeline.core.machine` but the one that resolves every
    `auto` for a stage (`pipeline.core.settings.auto`): builders and trainers take the resolved choice."""
    import ast

    from tests.factories import ROOT

    rules = {"resolve_precision", "resolve_weight_format", "resolve_distill", "resolve_bf16_row"}
    callers = set()
    for path in (ROOT / "pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in rules:
                    callers.add(str(path.relative_to(ROOT)))
    assert callers == {"pipeline/core/settings/auto.py"}


def test_a_body_that_ends_the_process_with_status_0_is_done(tmp_path, monkeypatch):
    """A torchrun launcher passes on its workers' status with `SystemExit`: status 0 (or none) is a stage that
    finished, logged "done" as a body that returns is, so the run summary counts it as run; another status is
    stopped."""
    import json

    import pytest

    from pipeline.core.stage import run_stage
    from pipeline.evaluation.run_summary import stage_times

    log = tmp_path / "stages.jsonl"
    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(log))

    def exits(code: int | None) -> None:
        raise SystemExit(code)

    for code in (0, None, 143):
        with pytest.raises(SystemExit):
            run_stage(name="finetune", body=lambda code=code: exits(code), run_id=f"unit-exit-{code}")
    outcomes = [json.loads(line)["outcome"] for line in log.read_text().splitlines()]
    assert outcomes == ["done", "done", "stopped (exit 143)"]
    ran = {t.stage: t.status for t in stage_times(log, "unit-exit-0")}
    assert ran["finetune"] == "ran"
    assert {t.stage: t.status for t in stage_times(log, "unit-exit-143")}["finetune"] == "stopped (exit 143)"


def _stage_process(tmp_path: Path, cleanup_seconds: float) -> tuple[Any, Path, Path, Path]:
    """A stage process whose body waits for a signal, and whose cleanup (`finally`) puts back the SIGTERM handler it
    saw when it started (as Lightning's signal connector and training's resume callback do when they tear down),
    marks a file, then takes `cleanup_seconds`; started once the body runs."""
    import subprocess
    import sys
    import textwrap

    from tests.factories import ROOT, wait_for_file

    log, started, cleaned = tmp_path / "stages.jsonl", tmp_path / "started", tmp_path / "cleaned"
    script = textwrap.dedent(f"""
        import signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from pipeline.core.stage import run_stage

        def body():
            saved = signal.getsignal(signal.SIGTERM)
            try:
                Path({str(started)!r}).touch()
                time.sleep(60)
            finally:
                signal.signal(signal.SIGTERM, saved)
                Path({str(cleaned)!r}).touch()
                time.sleep({cleanup_seconds})

        run_stage(name="package", body=body, run_id="unit-sigterm")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PIPELINE_STAGE_LOG": str(log)},
                            stderr=subprocess.PIPE, text=True)
    wait_for_file(started, proc)
    return proc, log, started, cleaned


def test_sigterm_stops_a_stage_as_ctrl_c_does_so_its_cleanup_runs(tmp_path):
    """`kill`, a scheduler's preemption or `docker stop` send SIGTERM: the stage's `finally` blocks run (its MLflow
    run ends KILLED, an unfinished registered version is deleted: `tests/unit/core/test_tracking.py`), it logs
    "stopped (exit 143)" and exits 143, as a shell reports a process SIGTERM killed."""
    import json
    import signal

    proc, log, _, cleaned = _stage_process(tmp_path, cleanup_seconds=0)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert cleaned.exists()
    assert [json.loads(line)["outcome"] for line in log.read_text().splitlines()] == ["stopped (exit 143)"]


def test_a_second_sigterm_ends_a_stage_whose_cleanup_hangs(tmp_path):
    """The first SIGTERM starts the cleanup; a second one ends the process at once, as a second Ctrl-C would be
    expected to (the next stage process then closes its run: `pipeline.core.process_identity`), even where the
    cleanup put the stage's handler back."""
    import signal

    from tests.factories import wait_for_file

    proc, _, _, cleaned = _stage_process(tmp_path, cleanup_seconds=60)
    try:
        proc.send_signal(signal.SIGTERM)
        wait_for_file(cleaned)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM


def test_a_sigterm_handler_already_set_is_left_to_do_its_job(tmp_path, monkeypatch):
    """Where SIGTERM already has a handler (a launcher's, a test runner's), the stage leaves it in place, and
    restores the default action after a body it stopped."""
    import signal

    from pipeline.core.stage import run_stage

    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(tmp_path / "stages.jsonl"))
    seen = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        def own(signum: int, frame: object) -> None:
            pass

        signal.signal(signal.SIGTERM, own)
        run_stage(name="demo", body=lambda: seen.append(signal.getsignal(signal.SIGTERM)), run_id="unit-own-handler")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        run_stage(name="demo", body=lambda: seen.append(signal.getsignal(signal.SIGTERM)), run_id="unit-default")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen[0] is own and seen[1] not in (own, signal.SIG_DFL)
