"""MLflow's model registry and logged models, read and moved: aliases (`@champion`), the version an alias names,
and whether a LoggedModel exists in the current store (and holds its files)."""

from __future__ import annotations

from typing import Any


def set_alias(name: str, alias: str, version: str) -> None:
    """Point `models:/<name>@<alias>` at `version` (moved from whichever version held it)."""
    import mlflow

    mlflow.MlflowClient().set_registered_model_alias(name, alias, version)


def alias_version(name: str, alias: str) -> str | None:
    """The version `models:/<name>@<alias>` points at, or None when the alias is not set."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def registered_version(name: str, alias: str) -> tuple[str, dict[str, str]]:
    """The version `models:/<name>@<alias>` points at and that version's tags (the package stage writes
    `variant` there); `LookupError` when the alias is not set."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        version = mlflow.MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        raise LookupError(f"models:/{name}@{alias} is not set in {mlflow.get_tracking_uri()}") from exc
    return str(version.version), dict(version.tags or {})


def version_tags(name: str, version: str) -> dict[str, str]:
    """The tags of version `version` of registered model `name`."""
    import mlflow

    return dict(mlflow.MlflowClient().get_model_version(name, version).tags or {})


def logged_model(model_id: str | None) -> Any:
    """The LoggedModel `model_id` in the current store, or None (no id, or one from another store)."""
    if not model_id:
        return None
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.MlflowClient().get_logged_model(model_id)
    except MlflowException:
        return None


def model_with_files(model_id: str | None) -> bool:
    """True when the LoggedModel `model_id` exists in the current store and MLflow holds its files (so it can
    be registered and served); False for an unknown id (another store) or an external model."""
    model = logged_model(model_id)
    return model is not None and "artifact_pointer" not in model.tags


def model_exists(model_id: str | None) -> bool:
    """True when the LoggedModel `model_id` exists in the current store (metrics can be linked to it)."""
    return logged_model(model_id) is not None
