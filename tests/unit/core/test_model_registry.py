"""The registry lookups tell "no such alias" from "the store could not answer"."""

from __future__ import annotations

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos import databricks_pb2

from pipeline.core import model_registry


class _Client:
    def __init__(self, error: MlflowException) -> None:
        self.error = error

    def get_model_version_by_alias(self, name: str, alias: str) -> None:
        raise self.error

    def get_logged_model(self, model_id: str) -> None:
        raise self.error


@pytest.mark.parametrize("code", ["RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"])
def test_an_alias_the_registry_does_not_have_is_not_set(monkeypatch, code):
    error = MlflowException("not found", error_code=getattr(databricks_pb2, code))
    monkeypatch.setattr(model_registry, "client_for", lambda uri: _Client(error))
    with pytest.raises(LookupError, match=r"models:/m@champion is not set in sqlite:///x.db \(not found\)"):
        model_registry.registered_version("m", "champion", tracking_uri="sqlite:///x.db")
    assert model_registry.alias_version("m", "champion", tracking_uri="sqlite:///x.db") is None


@pytest.mark.parametrize("code", ["INTERNAL_ERROR", "PERMISSION_DENIED", "TEMPORARILY_UNAVAILABLE"])
def test_a_store_that_fails_is_not_reported_as_a_missing_champion(monkeypatch, code):
    """A tracking server down or refusing is raised as MLflow raised it: neither "run make run" nor an unset
    previous champion (the package stage records `previous_champion_version`)."""
    error = MlflowException("API request failed: connection refused",
                            error_code=getattr(databricks_pb2, code))
    monkeypatch.setattr(model_registry, "client_for", lambda uri: _Client(error))
    for lookup in (model_registry.registered_version, model_registry.alias_version):
        with pytest.raises(MlflowException, match="connection refused"):
            lookup("m", "champion", tracking_uri="http://127.0.0.1:9")


def test_a_real_store_without_the_model_says_not_set(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(LookupError, match="is not set"):
        model_registry.registered_version("absent", "champion", tracking_uri=store)


def test_store_errors_carry_mlflows_message_and_let_a_missing_alias_pass(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the URI names no store: MLflow's default one (./mlflow.db) is made here
    with pytest.raises(model_registry.StoreError, match=r"^boom$"):
        with model_registry.store_errors():
            raise MlflowException("boom")
    with pytest.raises(LookupError), model_registry.store_errors():
        raise LookupError("not set")
    with pytest.raises(model_registry.StoreError):
        model_registry.check_model_uri("models:/absent-model@champion")


def test_a_logged_model_the_store_does_not_hold_is_none_but_a_failing_store_raises(monkeypatch, tmp_path):
    """An id from another store is "not here" (the package stage relogs the model, benchmark leaves its timings
    unlinked); a store that cannot answer is not taken for that."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for lookup in (model_registry.logged_model, model_registry.model_exists, model_registry.model_with_files):
        assert lookup("m-0123456789abcdef0123456789abcdef", tracking_uri=store) in (None, False)
        assert lookup(None, tracking_uri=store) in (None, False)
    error = MlflowException("API request failed: connection refused", error_code=databricks_pb2.INTERNAL_ERROR)
    monkeypatch.setattr(model_registry, "client_for", lambda uri: _Client(error))
    for lookup in (model_registry.logged_model, model_registry.model_exists, model_registry.model_with_files):
        with pytest.raises(MlflowException, match="connection refused"):
            lookup("m-0123456789abcdef0123456789abcdef", tracking_uri="http://127.0.0.1:9")
