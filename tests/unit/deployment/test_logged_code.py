"""Unit: a process that serves a logged model with its own `pipeline` package says so when that package differs
from the copy logged with the model (`pipeline.deployment.mlflow_model.warn_if_code_differs`)."""

from __future__ import annotations

import logging
import shutil

import pipeline
from pipeline.deployment.mlflow_model import warn_if_code_differs
from tests.factories import ROOT


def test_a_model_logged_with_other_code_is_named_in_a_warning(tmp_path, caplog):
    folder = tmp_path / "model"
    shutil.copytree(ROOT / "pipeline", folder / "code" / "pipeline",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # as log_predictor_model copies it
    with caplog.at_level(logging.WARNING, logger="pipeline.deployment.mlflow_model"):
        assert warn_if_code_differs(folder, "models:/m/1") is False
        assert caplog.records == []
        tokens = folder / "code" / "pipeline" / "data" / "tokens.py"
        tokens.write_text(tokens.read_text() + "\n# another commit's tokenization\n")
        assert warn_if_code_differs(folder, "models:/m/1") is True
    assert "models:/m/1 was logged with other pipeline/ code" in caplog.text
    assert warn_if_code_differs(tmp_path / "no-code", "models:/m/2") is False  # another flavour: nothing to compare
    assert pipeline.__file__.startswith(str(ROOT))  # the package compared against is this checkout's
