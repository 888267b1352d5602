"""`make run`'s bytecode warm-up: what it imports and what it records."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.core import import_warmup


def test_a_module_that_fails_to_import_is_named_and_the_rest_still_import():
    assert import_warmup.warm(("no_such_module_for_the_warmup", "json", "pipeline.core.errors")) == [
        "no_such_module_for_the_warmup"]


@pytest.mark.parametrize("name", import_warmup.MODULES)
def test_every_listed_module_exists_in_the_venv(name):
    """A renamed or removed module would make the warm-up skip it without a word (it tolerates import errors)."""
    assert importlib.util.find_spec(name) is not None


def test_the_stamp_says_how_many_imported_and_which_did_not(tmp_path, monkeypatch):
    monkeypatch.setattr(import_warmup, "MODULES", ("json", "no_such_module_for_the_warmup"))
    stamp = tmp_path / ".imports-warm"
    import_warmup.main(["--stamp", str(stamp)])
    text = stamp.read_text()
    assert text.startswith("1 of 2 modules imported in ") and text.endswith(
        "not importable: no_such_module_for_the_warmup\n")
