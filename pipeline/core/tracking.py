"""MLflow: one stage's run, a child of the pipeline's parent run (`pipeline.core.parent_run`), and what a stage
records on it: params, metrics, tags, artifacts, curves, datasets, the variants as MLflow models and their
registered versions; `tracked_stage` is the bookkeeping every simple stage shares.

This module, the parent run's (`pipeline.core.parent_run`), the registry's (`pipeline.core.model_registry`) and
the served model's (`pipeline.deployment.mlflow_model`) are the only ones that import MLflow (a test checks it):
the stages call `StageRun`'s methods and the functions below, so a change of MLflow API is a change there alone."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.core import process_identity
from pipeline.core.machine import decision_tags, thread_tags, torch_thread_tag
from pipeline.core.params import Params, flatten
from pipeline.core.parent_run import (
    ROLE_TAG,
    RUN_ID_TAG,
    TAG_LIMIT,
    VERSION_DONE_TAG,
    VERSION_RUN_TAG,
    RunContext,
    drop_if_unfinished,
    drop_unfinished_versions,
    flatten_numbers,
    log_batch,
    text_values,
)
from pipeline.core.run_id import git_commit

log = logging.getLogger(__name__)

PARAM_LIMIT = 500  # params longer than this (nested dicts and lists) are cut, their files hold the whole value


@dataclass(frozen=True)
class LoggedModelRef:
    """An MLflow LoggedModel of this pipeline: its id, its `models:/` URI, and whether MLflow holds its files
    (False: an external model whose files stay at the path in its `artifact_pointer` tag)."""

    model_id: str
    uri: str
    files: bool

    def to_dict(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "model_uri": self.uri, "model_files": self.files}


class StageRun:
    """The active MLflow run of one stage (or one variant of a stage): every MLflow call of the pipeline goes
    through this class or the functions of this module and `pipeline.core.parent_run`, so the stages' modules
    never import MLflow. `context` is the execution's (`pipeline.core.parent_run.RunContext`): calls by run id go
    through a client on its store."""

    def __init__(self, run: Any, context: RunContext) -> None:
        self.run = run
        self.run_id: str = run.info.run_id
        self.context = context

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params as given; nested values are written as (cut) text."""
        import mlflow

        mlflow.log_params({k: (v if not isinstance(v, dict | list | tuple) else str(v)[:PARAM_LIMIT])
                           for k, v in params.items()})

    def log_sections(self, sections: Mapping[str, Any]) -> None:
        """Params sections as `section.key`, so the compare view lines stages up."""
        log_params_flat(sections)

    def log_metrics(self, metrics: Mapping[str, Any], model_id: str | None = None, run_only: bool = False) -> None:
        """Every numeric leaf of a (nested) dict, as `a.b` keys; other values are skipped. With `model_id` the
        metrics are also the model's (the experiment's models view lines models up by them). MLflow links a
        run's metrics to the models that run logged; `run_only` keeps them on the run alone (bookkeeping that
        should not become a column of the models view)."""
        import mlflow

        if run_only:
            log_batch(self.context.client(), self.run_id, metrics=metrics)
        else:
            mlflow.log_metrics(flatten_numbers(metrics), model_id=model_id)

    def log_report(self, report: Mapping[str, Any], artifacts: Sequence[Path] = ()) -> None:
        """A stage's report: its numbers as metrics, its text (statuses, reasons) as tags, its files as
        artifacts."""
        self.log_metrics(report)
        self.set_tags(text_leaves(report))
        for path in artifacts:
            self.log_artifact(path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Tags, each value as text cut to MLflow's limit."""
        import mlflow

        mlflow.set_tags(text_values(tags, TAG_LIMIT))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(str(path), artifact_path)

    def log_artifacts(self, directory: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifacts(str(directory), artifact_path)

    def log_steps(self, points: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Curves: each (step, {name: value}) as metric points at that step, in as few calls as MLflow allows (a
        `pipeline.training.curves.CurveRecorder` sink)."""
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        metrics = [Metric(k, float(v), now, step) for step, values in points for k, v in values.items()]
        client = self.context.client()
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics a call
            client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close_interrupted(self, previous_run_id: str) -> None:
        """This run continues an interrupted attempt of the same stage: the earlier run, left RUNNING by a killed
        process, is marked KILLED, and each run names the other. (The curves up to the resumed step come from the
        checkpoint, `CurveRecorder`, not from the earlier run, which may hold points past it.)"""
        if self._end_previous(previous_run_id, "resume.continued_by"):
            self.set_tags({"resume.continues": previous_run_id})

    def close_replaced(self, previous_run_id: str) -> None:
        """The previous attempt's run, which this fresh start replaces without continuing its curves: marked KILLED
        if a hard-killed process left it RUNNING (nothing else would ever end it), and tagged with this run."""
        self._end_previous(previous_run_id, "resume.replaced_by")

    def _end_previous(self, previous_run_id: str, tag: str) -> bool:
        """Tag the previous attempt's run with this one (`tag`) and mark it KILLED if it is still RUNNING; False,
        logged, where it cannot be read: a run the store no longer holds (deleted, another store) at INFO, any other
        failure of the store at WARNING with its message (the stage goes on: closing it is bookkeeping)."""
        from mlflow.entities import RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

        client = self.context.client()
        try:
            previous = client.get_run(previous_run_id)
        except MlflowException as exc:
            if exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                log.info("previous attempt's run %s is not in the store: nothing to close", previous_run_id)
            else:
                log.warning("previous attempt's run %s could not be read (%s): left as it is", previous_run_id,
                            exc.message)
            return False
        client.set_tag(previous_run_id, tag, self.run_id)
        if previous.info.status == "RUNNING":
            client.set_terminated(previous_run_id, RunStatus.to_string(RunStatus.KILLED))
        return True

    def log_dataset(self, frame: pd.DataFrame, name: str, context: str, source: str,
                    hub_revision: str | None = None, targets: str | None = None) -> str:
        """Record a data split as an input of this run (`mlflow.log_input`): its name, schema, row count, source
        and a digest of its content, so runs on different data are told apart. `source` is a local path, or a
        Hugging Face dataset name when `hub_revision` is given. Returns the digest."""
        import warnings

        import mlflow

        with warnings.catch_warnings():
            # MLflow registers its local-file source twice and warns about that on every resolve, and warns that
            # an integer column (`label`) cannot hold missing values; neither applies to a prepared split
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
            if hub_revision is not None:
                from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

                dataset_source: Any = HuggingFaceDatasetSource(source, revision=hub_revision)
            else:
                from mlflow.data.dataset_source_registry import resolve_dataset_source

                dataset_source = resolve_dataset_source(str(Path(source).resolve()))
            dataset = mlflow.data.from_pandas(frame, source=dataset_source, name=name, targets=targets)
            mlflow.log_input(dataset, context=context)  # the schema is inferred here
        return str(dataset.digest)

    def log_external_model(self, name: str, pointer: Path, params: Mapping[str, Any] | None = None,
                           tags: Mapping[str, Any] | None = None, model_type: str | None = None) -> LoggedModelRef:
        """A LoggedModel of this run whose files stay outside MLflow (at `pointer`, recorded as the tag
        `artifact_pointer`): it lines up with the other models by its metrics without copying large files."""
        import mlflow

        model = mlflow.create_external_model(
            name=name, source_run_id=self.run_id, params=text_values(params or {}, PARAM_LIMIT),
            tags=text_values({**(tags or {}), "artifact_pointer": Path(pointer).resolve()}, TAG_LIMIT),
            model_type=model_type)
        return LoggedModelRef(model.model_id, f"models:/{model.model_id}", files=False)

    @contextlib.contextmanager
    def registering(self, name: str, model_uri: str, description: str,
                    tags: Mapping[str, Any] | None = None) -> Iterator[str]:
        """A new version of registered model `name` from `model_uri` (`models:/<model_id>`), its number yielded to
        the body that finishes it (builds what serves it, moves an alias to it). A version outlives its body only
        when the body completes or an alias names it: one whose body raises (an error, Ctrl-C) is deleted, so that
        `models:/<name>/latest` never names a version whose packaging did not finish; so is one created by a
        registration stopped midway. SIGTERM stops a stage as Ctrl-C does (`pipeline.core.stage.run_stage`); a
        stage killed outright (SIGKILL) runs no handler here, but the version carries this run's id
        (`VERSION_RUN_TAG`), and the next stage process to start deletes it with the run (`close_orphaned_runs`).
        Finished versions are only ever added (`VERSION_DONE_TAG` says so): re-running keeps every earlier one."""
        import mlflow
        from mlflow.exceptions import MlflowException

        client = self.context.client()
        try:
            client.create_registered_model(name, description=description)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            version = mlflow.register_model(
                model_uri, name, tags=text_values({**(tags or {}), VERSION_RUN_TAG: self.run_id}, TAG_LIMIT))
        except BaseException:  # stopped inside the call (Ctrl-C, SIGTERM): the store may have created the version
            with contextlib.suppress(Exception):  # the stop (or the registry's error) is what to report
                drop_unfinished_versions(client, self.run_id, name=name)
            raise
        number = str(version.version)
        try:
            yield number
        except BaseException:
            try:
                if drop_if_unfinished(client, name, number):
                    log.warning("deleted version %s of %s: its packaging did not finish", number, name)
            except MlflowException as exc:  # the store failed too: the stage's own error is the one to report
                log.warning("version %s of %s is left without an alias (%s)", number, name, exc.message)
            raise
        client.set_model_version_tag(name, number, VERSION_DONE_TAG, "true")
        self.set_tags({"registered_model_version": number})


@contextlib.contextmanager
def stage_run(context: RunContext, stage: str, *, run_name: str | None = None,
              tags: Mapping[str, str] | None = None, system_metrics: bool = False) -> Iterator[StageRun]:
    """A child run of the execution's parent run (`context`, resolved once where the stage started), in its
    experiment, active for the `with` body; `system_metrics` samples the machine's CPU, memory, disk and network
    (and GPU) load into it as `system/*` metrics. A body stopped by a signal ends the run KILLED (MLflow's run
    context would end it FAILED, as after any exception): Ctrl-C, or an exit with a signal's status, 128 + its
    number, as training exits once its preemption checkpoint is written (`training.resume.Preempted`)."""
    import mlflow

    all_tags = {RUN_ID_TAG: context.run_id, ROLE_TAG: "stage", "pipeline.stage": stage,
                "git.commit": git_commit(), "mlflow.parentRunId": context.parent_run_id, **decision_tags(),
                **thread_tags(), **process_identity.current(), **(tags or {})}
    with mlflow.start_run(experiment_id=context.experiment_id, run_name=run_name or stage, tags=all_tags,
                          log_system_metrics=True if system_metrics else None) as run:
        try:
            yield StageRun(run, context)
        except (KeyboardInterrupt, SystemExit) as exc:
            if isinstance(exc, KeyboardInterrupt) or (isinstance(exc.code, int) and exc.code >= 128):
                mlflow.end_run("KILLED")  # ended here, MLflow's run context leaves it as it is
            raise
        mlflow.set_tags(torch_thread_tag())  # as the stage left them, where its work loaded torch


def log_params_flat(sections: Mapping[str, Any]) -> None:
    """Log nested params as `section.key` so the MLflow compare view can line stages up."""
    import mlflow

    flat: dict[str, Any] = {}
    for name, values in sections.items():
        for key, value in dict(values).items():
            flat[f"{name}.{key}"] = value
    mlflow.log_params(flat)


def text_leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """String leaves of a nested dict as `a.b` keys (a stage report's statuses and reasons)."""
    return {key: value for key, value in flatten(d, prefix).items() if isinstance(value, str)}


def tracked_stage(context: RunContext, *, params: Params, stage: str, sections: Sequence[str],
                  body: Callable[[], Mapping[str, Any]], artifacts: Sequence[Path] = ()) -> Mapping[str, Any]:
    """The MLflow bookkeeping every simple stage shares: one child run under the execution's parent (`context`),
    the params sections the stage reads, the numbers its work returns as metrics and its text (statuses,
    reasons) as tags, and the files it wrote as artifacts."""
    from pipeline.core.params import to_dict

    with stage_run(context, stage) as run:
        run.log_sections({name: to_dict(getattr(params, name)) for name in sections})
        report = body()
        run.log_report(report, artifacts)
        return report
