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


@contextlib.contextmanager
def stage_run(params: MlflowParams, stage: str, run_name: str | None = None,
              tags: Mapping[str, str] | None = None) -> Iterator[Any]:
    """A child run of the pipeline's parent run, active for the `with` body."""
    import mlflow

    parent = parent_run_id(params)
    all_tags = {RUN_ID_TAG: pipeline_run_id(), ROLE_TAG: "stage", "pipeline.stage": stage,
                "git.commit": git_commit(), "mlflow.parentRunId": parent, **(tags or {})}
    with mlflow.start_run(run_name=run_name or stage, tags=all_tags) as run:
        yield run


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


def log_metrics_flat(metrics: Mapping[str, Any]) -> None:
    """Log every numeric leaf of a (nested) metrics dict to the active run."""
    import mlflow

    mlflow.log_metrics(flatten_numbers(metrics))


def tracked_stage(params: Params, stage: str, sections: Sequence[str],
                  body: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any]:
    """The MLflow bookkeeping every simple stage shares: one child run under the pipeline's parent, the params
    sections the stage reads, and the numbers its work returns as metrics."""
    from pipeline.core.params import to_dict

    with stage_run(params.mlflow, stage):
        log_params_flat({name: to_dict(getattr(params, name)) for name in sections})
        metrics = body()
        log_metrics_flat(metrics)
        return metrics
