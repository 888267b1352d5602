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


def test_a_stage_says_what_it_does_and_how_long_it_took(caplog):
    import pytest

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
