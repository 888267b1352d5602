"""MLflow: one parent run per pipeline execution, one child run per stage (and per variant).

Stages run as separate processes under `dvc repro`, so they find their shared parent by a tag:
`pipeline.run_id`, taken from `PIPELINE_RUN_ID` (set once per `make run`) or, when `dvc repro` is
called directly, derived from the git commit (plus `-dirty` for uncommitted changes)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.params import MlflowParams, Params, flatten

RUN_ID_TAG = "pipeline.run_id"


ROLE_TAG = "pipeline.role"


def pipeline_run_id() -> str:
    """Identifier shared by all stages of one pipeline execution."""
    explicit = os.environ.get("PIPELINE_RUN_ID")
    if explicit:
        return explicit
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "no-git"


def git_commit() -> str:
    """The current commit, or 'unknown' outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def configure(params: MlflowParams) -> str:
    """Point MLflow at the configured store and experiment; returns the experiment id."""
    import mlflow

    mlflow.set_tracking_uri(params.tracking_uri)
    return mlflow.set_experiment(params.experiment).experiment_id


def parent_run_id(params: MlflowParams) -> str:
    """Find or create the parent run of this pipeline execution."""
    import mlflow

    experiment_id = configure(params)
    rid = pipeline_run_id()
    found = mlflow.search_runs(
        experiment_ids=[experiment_id],
        filter_string=f"tags.`{RUN_ID_TAG}` = '{rid}' and tags.`{ROLE_TAG}` = 'parent'",
        output_format="list", max_results=1,
    )
    if found:
        return found[0].info.run_id
    client = mlflow.MlflowClient()
    run = client.create_run(experiment_id, run_name=f"pipeline-{rid}",
                            tags={RUN_ID_TAG: rid, ROLE_TAG: "parent", "git.commit": git_commit()})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


TAG_LIMIT = 5000  # MLflow's limit on a tag value's length
PARAM_LIMIT = 500  # params longer than this (nested dicts and lists) are cut, their files hold the whole value


class StageRun:
    """The active MLflow run of one stage (or one variant of a stage): every MLflow call of the pipeline goes
    through this class or the functions of this module, so the stages' modules never import MLflow."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.run_id: str = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params as given; nested values are written as (cut) text."""
        import mlflow

        mlflow.log_params({k: (v if not isinstance(v, dict | list | tuple) else str(v)[:PARAM_LIMIT])
                           for k, v in params.items()})

    def log_sections(self, sections: Mapping[str, Any]) -> None:
        """Params sections as `section.key`, so the compare view lines stages up."""
        log_params_flat(sections)

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Every numeric leaf of a (nested) dict, as `a.b` keys; other values are skipped."""
        import mlflow

        mlflow.log_metrics(flatten_numbers(metrics))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Tags, each value as text cut to MLflow's limit."""
        import mlflow

        mlflow.set_tags({k: str(v)[:TAG_LIMIT] for k, v in tags.items()})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(str(path), artifact_path)

    def log_artifacts(self, directory: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifacts(str(directory), artifact_path)

    def artifact_uri(self, artifact_path: str) -> str:
        import mlflow

        return mlflow.get_artifact_uri(artifact_path)

    def lightning_logger(self, params: MlflowParams) -> Any:
        """Lightning's MLflow logger writing into this run (training curves and hyperparameters)."""
        from lightning.pytorch.loggers import MLFlowLogger

        return MLFlowLogger(tracking_uri=params.tracking_uri, run_id=self.run_id)

    def register_version(self, name: str, artifact_path: str, description: str,
                         tags: Mapping[str, str] | None = None) -> str:
        """A new version of registered model `name` from this run's `artifact_path`; returns its number."""
        import mlflow
        from mlflow.exceptions import MlflowException

        client = mlflow.MlflowClient()
        try:
            client.create_registered_model(name, description=description)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(name, source=self.artifact_uri(artifact_path), run_id=self.run_id,
                                              tags=dict(tags or {}))
        self.set_tags({"registered_model_version": version.version})
        return str(version.version)


@contextlib.contextmanager
def stage_run(params: MlflowParams, stage: str, run_name: str | None = None,
              tags: Mapping[str, str] | None = None) -> Iterator[StageRun]:
    """A child run of the pipeline's parent run, active for the `with` body."""
    import mlflow

    parent = parent_run_id(params)
    all_tags = {RUN_ID_TAG: pipeline_run_id(), ROLE_TAG: "stage", "pipeline.stage": stage,
                "git.commit": git_commit(), "mlflow.parentRunId": parent, **(tags or {})}
    with mlflow.start_run(run_name=run_name or stage, tags=all_tags) as run:
        yield StageRun(run)


def log_params_flat(sections: Mapping[str, Any]) -> None:
    """Log nested params as `section.key` so the MLflow compare view can line stages up."""
    import mlflow

    flat: dict[str, Any] = {}
    for name, values in sections.items():
        for key, value in dict(values).items():
            flat[f"{name}.{key}"] = value
    mlflow.log_params(flat)


def log_parent_artifact(params: MlflowParams, local_path: Path, artifact_path: str | None = None) -> None:
    """Attach a file to the parent run (e.g. the variant comparison)."""
    import mlflow

    mlflow.MlflowClient().log_artifact(parent_run_id(params), str(local_path), artifact_path)


def flatten_numbers(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as `a.b` keys (non-numbers are skipped)."""
    return {key: float(value) for key, value in flatten(d, prefix).items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def text_leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """String leaves of a nested dict as `a.b` keys (a stage report's statuses and reasons)."""
    return {key: value for key, value in flatten(d, prefix).items() if isinstance(value, str)}


def tracked_stage(params: Params, stage: str, sections: Sequence[str], body: Callable[[], Mapping[str, Any]],
                  artifacts: Sequence[Path] = ()) -> Mapping[str, Any]:
    """The MLflow bookkeeping every simple stage shares: one child run under the pipeline's parent, the params
    sections the stage reads, the numbers its work returns as metrics and its text (statuses, reasons) as
    tags, and the files it wrote as artifacts."""
    from pipeline.core.params import to_dict

    with stage_run(params.mlflow, stage) as run:
        run.log_sections({name: to_dict(getattr(params, name)) for name in sections})
        report = body()
        run.log_metrics(report)
        run.set_tags(text_leaves(report))
        for path in artifacts:
            run.log_artifact(path)
        return report
