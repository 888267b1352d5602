"""MLflow's store and the pipeline's parent run: which store and experiment the runs go to, the one parent run
of a pipeline execution (found by its `pipeline.run_id` tag, or created), and what goes on it or on any run by id
(headline numbers, tables, files), outside an active run.

Stages run as separate processes under `dvc repro`, so they find their shared parent by a tag:
`pipeline.run_id` (`pipeline.core.run_id.pipeline_run_id`: one per `make run` or `dvc repro`). A stage's own run
is `pipeline.core.tracking`'s."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.core.machine import decision_tags
from pipeline.core.params import MlflowParams, flatten
from pipeline.core.run_id import git_commit, pipeline_run_id

RUN_ID_TAG = "pipeline.run_id"
ROLE_TAG = "pipeline.role"

#: MLflow 3 opens an experiment by this tag: `custom_model_development` is its model-training view (runs,
#: models, charts); without the tag a new experiment may open in the GenAI overview ("Traces: 0").
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

TAG_LIMIT = 5000  # MLflow's limit on a tag value's length


def tracking_uri(params: MlflowParams) -> str:
    """The tracking store: `$MLFLOW_TRACKING_URI` when set (a remote server, `http://host:port`), else params'."""
    return os.environ.get("MLFLOW_TRACKING_URI") or params.tracking_uri


def use_store(params: MlflowParams) -> str:
    """Point MLflow at the tracking store (`tracking_uri`) and return it (a server's start: no experiment)."""
    import mlflow

    store = tracking_uri(params)
    mlflow.set_tracking_uri(store)
    return store


def configure(params: MlflowParams) -> str:
    """Point MLflow at the store (`tracking_uri`) and the experiment, marked as a model-training experiment;
    returns the experiment id."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(params))
    experiment = mlflow.set_experiment(params.experiment)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


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
                            tags={RUN_ID_TAG: rid, ROLE_TAG: "parent", "git.commit": git_commit(), **decision_tags()})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def text_values(values: Mapping[str, Any], limit: int) -> dict[str, str]:
    """Every value as text cut to `limit` characters (MLflow's tags and model params are strings)."""
    return {k: str(v)[:limit] for k, v in values.items()}


def flatten_numbers(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as `a.b` keys (non-numbers are skipped)."""
    return {key: float(value) for key, value in flatten(d, prefix).items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def log_batch(run_id: str, metrics: Mapping[str, Any], tags: Mapping[str, Any] | None = None) -> None:
    """Numeric leaves of `metrics` and `tags` (as cut text) on run `run_id`, whether or not it is active, in
    one call; metrics logged this way are the run's alone, never linked to a model."""
    import mlflow
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.time import get_current_time_millis

    now = get_current_time_millis()
    mlflow.MlflowClient().log_batch(
        run_id, metrics=[Metric(k, v, now, 0) for k, v in flatten_numbers(metrics).items()],
        tags=[RunTag(k, v) for k, v in text_values(tags or {}, TAG_LIMIT).items()])


def log_parent_artifact(params: MlflowParams, local_path: Path, artifact_path: str | None = None) -> None:
    """Attach a file to the parent run (e.g. the variant comparison)."""
    import mlflow

    mlflow.MlflowClient().log_artifact(parent_run_id(params), str(local_path), artifact_path)


def log_parent_summary(params: MlflowParams, metrics: Mapping[str, Any], tags: Mapping[str, Any]) -> str:
    """The pipeline's headline numbers and names on the parent run, so the runs page charts them on first
    open; returns the parent run's id."""
    parent = parent_run_id(params)
    log_batch(parent, metrics, tags)
    return parent


def log_parent_table(params: MlflowParams, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
    """A table on the parent run (`mlflow.log_table`: shown as a table in the artifacts view). MLflow appends
    to a table file that already exists, so rows should say which run wrote them."""
    import mlflow

    mlflow.log_table(pd.DataFrame([dict(r) for r in rows]), artifact_file, run_id=parent_run_id(params))
