"""Unit tests for the stage plumbing in `pipeline.core.stage`."""

from __future__ import annotations

import logging
import os

from pipeline.core.stage import QuietThirdPartyRootInfo


def _record(name: str, level: int, path: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, path, 1, "message", None, None)


def test_root_info_from_onnxruntime_is_dropped_but_warnings_and_our_lines_stay():
    quiet = QuietThirdPartyRootInfo()
    ort = os.sep.join(["", "venv", "site-packages", "onnxruntime", "quantization", "qdq_quantizer.py"])
    ours = os.sep.join(["", "repo", "pipeline", "quantize.py"])
    assert not quiet.filter(_record("root", logging.INFO, ort))
    assert not quiet.filter(_record("root", logging.DEBUG, ort))
    assert quiet.filter(_record("root", logging.WARNING, ort))
    assert quiet.filter(_record("root", logging.INFO, ours))
    assert quiet.filter(_record("pipeline.quantize", logging.INFO, ours))
    # a named onnxruntime logger is left to its own level
    assert quiet.filter(_record("onnxruntime.quantization.preprocess", logging.INFO, ort))


def test_a_stage_says_what_it_does_and_how_long_it_took(caplog, tmp_path, monkeypatch):
    import json

    import pytest

    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(tmp_path / "stages.jsonl"))
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-stage")

    from pipeline.core.params import ParamsError
    from pipeline.core.stage import run_stage

    with caplog.at_level(logging.INFO, logger="pipeline.stage"):
        run_stage("demo", lambda: None)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.stage"]
    assert lines[0].startswith("==> demo: ") and lines[1].startswith("<== demo done in ")

    def bad() -> None:
        raise ParamsError("train.lr: must be > 0")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.stage"), pytest.raises(SystemExit) as stop:
        run_stage("demo", bad)
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
        run_stage("evaluate", body)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == "error: stage 'evaluate' failed: variant x was skipped: no GPU"


def test_a_programming_error_keeps_its_traceback():
    import pytest

    from pipeline.core.stage import run_stage

    def body() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_stage("evaluate", body)


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
