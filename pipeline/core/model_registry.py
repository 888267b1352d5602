"""MLflow's model registry and logged models, read and moved: aliases (`@champion`), the version an alias names,
and whether a LoggedModel exists in a store (and holds its files). Every function takes the store it asks
(`tracking_uri`: a stage's `RunContext.tracking_uri`, the server's store) and talks to it through a client made
for it, so none depends on, or changes, MLflow's process-wide tracking URI."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pipeline.core.parent_run import VERSION_RUN_TAG, client_for

#: The error codes of a registry that answered and has no such alias or model (an unknown alias is
#: INVALID_PARAMETER_VALUE, an unknown model RESOURCE_DOES_NOT_EXIST); every other error is the store's.
NOT_SET = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


class StoreError(RuntimeError):
    """The tracking store could not give what was asked (unreachable, refused, no such model or version), with
    MLflow's message: what the commands report without importing MLflow themselves."""


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """MLflow's failures in the block raised as `StoreError` (a `LookupError` from `registered_version` passes)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise StoreError(exc.message) from exc


def check_model_uri(model_uri: str) -> None:
    """`StoreError` (or `OSError` for a path that is not there) when MLflow cannot resolve `model_uri`; reads only
    the model's MLmodel file, in MLflow's process-wide store."""
    import mlflow

    with store_errors():
        mlflow.models.get_model_info(model_uri)


def set_alias(name: str, alias: str, version: str, *, tracking_uri: str) -> None:
    """Point `models:/<name>@<alias>` at `version` (moved from whichever version held it)."""
    client_for(tracking_uri).set_registered_model_alias(name, alias, version)


def alias_version(name: str, alias: str, *, tracking_uri: str) -> str | None:
    """The version `models:/<name>@<alias>` points at, or None when the alias (or the model) is not set; any other
    failure to read the registry (a tracking server down, a refused login) is raised as MLflow raised it."""
    try:
        return registered_version(name, alias, tracking_uri=tracking_uri)[0]
    except LookupError:
        return None


def registered_version(name: str, alias: str, *, tracking_uri: str) -> tuple[str, dict[str, str]]:
    """The version `models:/<name>@<alias>` points at and that version's tags (the package stage writes
    `variant` there). `LookupError` when the registry answers that the alias or the model is not there; any other
    `MlflowException` (the store unreachable, a refused login, a schema MLflow cannot read) is raised as it is, so
    that it is not reported as a missing champion."""
    from mlflow.exceptions import MlflowException

    try:
        version = client_for(tracking_uri).get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code not in NOT_SET:
            raise
        raise LookupError(f"models:/{name}@{alias} is not set in {tracking_uri} ({exc.message})") from exc
    return str(version.version), dict(version.tags or {})


def version_tags(name: str, version: str, *, tracking_uri: str) -> dict[str, str]:
    """The tags of version `version` of registered model `name`."""
    return dict(client_for(tracking_uri).get_model_version(name, version).tags or {})


def version_package_params(tags: dict[str, str], *, tracking_uri: str) -> tuple[str, dict[str, str]] | None:
    """The package section (`package.*` params, prefix dropped) that the package run named in a registered
    version's tags (`VERSION_RUN_TAG`) logged, with that run's id; None when the tags name no run. `LookupError`
    when the store cannot give that run's params."""
    from mlflow.exceptions import MlflowException

    run_id = tags.get(VERSION_RUN_TAG)
    if not run_id:
        return None
    try:
        params = client_for(tracking_uri).get_run(run_id).data.params
    except MlflowException as exc:
        raise LookupError(f"package run {run_id}: {exc.message}") from exc
    return run_id, {k.removeprefix("package."): v for k, v in params.items() if k.startswith("package.")}


def logged_model(model_id: str | None, *, tracking_uri: str) -> Any:
    """The LoggedModel `model_id` in the store, or None (no id, or one the store answers it does not hold: from
    another store); any other failure to read the store (a server down, a refused login) is raised as MLflow
    raised it, not taken for a missing model."""
    if not model_id:
        return None
    from mlflow.exceptions import MlflowException

    try:
        return client_for(tracking_uri).get_logged_model(model_id)
    except MlflowException as exc:
        if exc.error_code in NOT_SET:
            return None
        raise


def model_with_files(model_id: str | None, *, tracking_uri: str) -> bool:
    """True when the LoggedModel `model_id` exists in the store and MLflow holds its files (so it can be
    registered and served); False for an unknown id (another store) or an external model."""
    model = logged_model(model_id, tracking_uri=tracking_uri)
    return model is not None and "artifact_pointer" not in model.tags


def model_exists(model_id: str | None, *, tracking_uri: str) -> bool:
    """True when the LoggedModel `model_id` exists in the store (metrics can be linked to it)."""
    return logged_model(model_id, tracking_uri=tracking_uri) is not None
