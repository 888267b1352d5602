"""MLflow's store and the pipeline's parent run: which store and experiment the runs go to, the one parent run
of a pipeline execution (found by its `pipeline.run_id` tag, or created), and what goes on it or on any run by id
(headline numbers, tables, files), outside an active run.

Stages run as separate processes under `dvc repro`, so they find their shared parent by a tag: `pipeline.run_id`
(`pipeline.core.run_id.pipeline_run_id`: one per `make run`, `dvc exp run` or `PIPELINE_RUN_ID`). A stage process
looks its parent up once, where it starts (`start_tracking`), and passes the answer down as a `RunContext` to
everything that opens a stage run (`pipeline.core.tracking.stage_run`) or writes to the parent (the `log_parent_*`
functions below): nothing below that point searches the store or re-points MLflow again. Those functions talk to
the store through a client made for the context's store, never through MLflow's process-wide settings. A stage's
own run is `pipeline.core.tracking`'s."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.core import process_identity
from pipeline.core.errors import UserError
from pipeline.core.machine import decision_tags
from pipeline.core.params import MlflowParams, flatten
from pipeline.core.run_id import git_commit

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

RUN_ID_TAG = "pipeline.run_id"
ROLE_TAG = "pipeline.role"

#: MLflow 3 opens an experiment by this tag: `custom_model_development` is its model-training view (runs,
#: models, charts); without the tag a new experiment may open in the GenAI overview ("Traces: 0").
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

TAG_LIMIT = 5000  # MLflow's limit on a tag value's length


@dataclass(frozen=True)
class RunContext:
    """One pipeline execution as one stage process sees it, resolved once (`resolve_run_context`) and passed down
    to whatever opens a stage run or logs to the parent run."""

    run_id: str
    """the execution's id (`pipeline.core.run_id`), the parent run's `pipeline.run_id` tag"""
    parent_run_id: str
    """MLflow's id of the execution's parent run"""
    tracking_uri: str
    """the store (`tracking_uri`), as resolved when the stage started"""
    experiment_id: str
    """the experiment holding the parent run and the stage runs"""

    def client(self) -> MlflowClient:
        """An MLflow client on this context's store (MLflow's process-wide tracking URI is neither read nor set)."""
        return client_for(self.tracking_uri)


def tracking_uri(params: MlflowParams) -> str:
    """The tracking store: `$MLFLOW_TRACKING_URI` when set (a remote server, `http://host:port`), else params'."""
    return os.environ.get("MLFLOW_TRACKING_URI") or params.tracking_uri


def client_for(store: str) -> MlflowClient:
    """An MLflow client on tracking store `store`; its model registry is the same store unless
    `$MLFLOW_REGISTRY_URI` names another (MLflow's own rule)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store)


def local_artifact_root(store: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlruns/` beside the database file, as an
    absolute path, whatever the working directory (MLflow's own default is `./mlruns` of the process that creates
    the experiment). None for a tracking server, which decides itself."""
    prefix = "sqlite:///"
    if not store.startswith(prefix):
        return None
    return str((Path(store[len(prefix):]).parent / "mlruns").resolve())


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of the active experiment `name` in the client's store, created when absent, and marked as a
    model-training experiment (`EXPERIMENT_KIND_TAG`)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=local_artifact_root(client.tracking_uri),
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as exc:  # another stage process created it meanwhile
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage != "active":
        raise UserError(f"MLflow experiment {name!r} is deleted in {client.tracking_uri}: restore it "
                        "(`mlflow experiments restore`) or name another in mlflow.experiment")
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


def resolve_run_context(params: MlflowParams, *, run_id: str) -> RunContext:
    """The store (`tracking_uri`), the experiment `params.experiment` and the parent run tagged
    `pipeline.run_id = run_id` (found, or created and marked finished), looked up through a client on that store:
    one search for the parent, whatever the caller logs afterwards."""
    store = tracking_uri(params)
    client = client_for(store)
    experiment = experiment_id(client, params.experiment)
    found = client.search_runs(
        [experiment], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}' and tags.`{ROLE_TAG}` = 'parent'",
        max_results=1)
    if found:
        parent = found[0].info.run_id
    else:
        run = client.create_run(experiment, run_name=f"pipeline-{run_id}",
                                tags={RUN_ID_TAG: run_id, ROLE_TAG: "parent", "git.commit": git_commit(),
                                      **decision_tags()})
        client.set_terminated(run.info.run_id)
        parent = run.info.run_id
    return RunContext(run_id=run_id, parent_run_id=parent, tracking_uri=store, experiment_id=experiment)


#: On a registered model version: the stage run that registered it, and (once that run finished packaging it)
#: that it was finished (`StageRun.registering`).
VERSION_RUN_TAG, VERSION_DONE_TAG = "pipeline.stage_run_id", "pipeline.packaged"


def close_orphaned_runs(context: RunContext) -> list[str]:
    """End as KILLED the stage runs that a killed process left RUNNING: on this host, with a process id no process
    has any more, told by `pipeline.core.process_identity.has_ended` (a SIGKILL runs no handler, so nothing else
    would ever end them; a training job's resume also links its interrupted run, `StageRun.close_interrupted`),
    and delete the registered versions such a run
    left that no alias names (`drop_unfinished_versions`). Returns the runs' ids."""
    from mlflow.entities import RunStatus

    client = context.client()
    host_tag = process_identity.HOST_TAG
    here = process_identity.current()
    host = here.get(host_tag)
    if not host:
        return []  # no host name to tell this machine's runs by
    found = client.search_runs([context.experiment_id], max_results=200, filter_string=(
        f"attributes.status = 'RUNNING' and tags.`{ROLE_TAG}` = 'stage' and tags.`{host_tag}` = '{host}'"))
    closed = []
    for run in found:
        if not process_identity.has_ended(run.data.tags, here):
            continue  # its process may be there (a stage running beside this one, another container): left alone
        client.set_tag(run.info.run_id, "pipeline.closed_as_orphan_by", context.run_id)
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        drop_unfinished_versions(client, run.info.run_id)
        closed.append(run.info.run_id)
    return closed


def drop_unfinished_versions(client: MlflowClient, stage_run_id: str,
                             name: str | None = None) -> list[tuple[str, str]]:
    """Delete the registered model versions that stage run `stage_run_id` registered (`VERSION_RUN_TAG`) and neither
    finished (`VERSION_DONE_TAG`) nor has an alias on: versions whose packaging did not finish, which
    `models:/<name>/latest` would otherwise resolve to. A finished version stays whatever happened to its alias
    since. Best effort: a registry that refuses is logged, not raised (the stage starting is not its business).
    With `name`, of that registered model only. Returns the deleted ones as (name, version)."""
    from mlflow.exceptions import MlflowException

    dropped = []
    try:
        for found in client.search_model_versions(f"tags.`{VERSION_RUN_TAG}` = '{stage_run_id}'"):
            if name is not None and found.name != name:
                continue
            if drop_if_unfinished(client, found.name, str(found.version)):
                dropped.append((found.name, str(found.version)))
    except MlflowException as exc:
        log.warning("the unfinished versions of stage run %s are left (%s)", stage_run_id, exc.message)
    return dropped


def drop_if_unfinished(client: MlflowClient, name: str, version: str) -> bool:
    """Delete version `version` of registered model `name` if its packaging did not finish (no `VERSION_DONE_TAG`)
    and no alias names it; returns whether it did. (A version search leaves `aliases` empty: the version is read.)"""
    found = client.get_model_version(name, version)
    if VERSION_DONE_TAG in (found.tags or {}) or found.aliases:
        return False
    client.delete_model_version(name, version)
    return True


def start_tracking(params: MlflowParams, *, run_id: str) -> RunContext:
    """A stage process's MLflow, set up once where the stage starts: its `RunContext` (`resolve_run_context`), and
    MLflow's fluent API, which opens the stage's own runs and logs its models and datasets, pointed at the same
    store. MLflow's `set_tracking_uri` also copies the store into this process's `MLFLOW_TRACKING_URI` (MLflow's
    doing, so that the processes a stage starts log to the same store); the scoring server never calls this."""
    import mlflow

    context = resolve_run_context(params, run_id=run_id)
    mlflow.set_tracking_uri(context.tracking_uri)
    close_orphaned_runs(context)
    return context


def use_store(params: MlflowParams) -> str:
    """Point MLflow's fluent API at the tracking store (`tracking_uri`) and return it: for a command that hands a
    `models:/` URI to MLflow code that takes no store of its own (batch scoring's Spark UDF)."""
    import mlflow

    store = tracking_uri(params)
    mlflow.set_tracking_uri(store)
    return store


def text_values(values: Mapping[str, Any], limit: int) -> dict[str, str]:
    """Every value as text cut to `limit` characters (MLflow's tags and model params are strings)."""
    return {k: str(v)[:limit] for k, v in values.items()}


def flatten_numbers(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as `a.b` keys (non-numbers are skipped)."""
    return {key: float(value) for key, value in flatten(d, prefix).items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def log_batch(client: MlflowClient, run_id: str, *, metrics: Mapping[str, Any],
              tags: Mapping[str, Any] | None = None) -> None:
    """Numeric leaves of `metrics` and `tags` (as cut text) on run `run_id`, whether or not it is active, in
    one call; metrics logged this way are the run's alone, never linked to a model."""
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.time import get_current_time_millis

    now = get_current_time_millis()
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in flatten_numbers(metrics).items()],
                     tags=[RunTag(k, v) for k, v in text_values(tags or {}, TAG_LIMIT).items()])


def log_parent_artifact(context: RunContext, local_path: Path, *, artifact_path: str | None = None) -> None:
    """Attach a file to the parent run (e.g. the variant comparison)."""
    context.client().log_artifact(context.parent_run_id, str(local_path), artifact_path)


def log_parent_summary(context: RunContext, *, metrics: Mapping[str, Any], tags: Mapping[str, Any]) -> str:
    """The pipeline's headline numbers and names on the parent run, so the runs page charts them on first
    open; returns the parent run's id."""
    log_batch(context.client(), context.parent_run_id, metrics=metrics, tags=tags)
    return context.parent_run_id


def log_parent_table(context: RunContext, *, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
    """A table on the parent run (MLflow's `log_table`: shown as a table in the artifacts view). MLflow appends
    to a table file that already exists, so rows should say which run wrote them."""
    context.client().log_table(context.parent_run_id, pd.DataFrame([dict(r) for r in rows]), artifact_file)
