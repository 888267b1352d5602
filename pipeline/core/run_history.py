"""What MLflow holds about one pipeline run's stages, read back: each stage's wall time and status (the summary
`make run` prints, `pipeline.evaluation.run_summary`)."""

from __future__ import annotations

from pipeline.core.tracking import ROLE_TAG, RUN_ID_TAG


def stage_run_times(tracking_uri: str, experiment: str, run_id: str) -> dict[str, tuple[float, str]]:
    """Stage name -> (seconds, status) of the newest stage run tagged with pipeline run `run_id`; status is the
    run's `status` tag (e.g. `skipped`) or its MLflow state. A stage without a run of this id is absent."""
    import time

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}' and tags.`{ROLE_TAG}` = 'stage'",
                              order_by=["attributes.start_time DESC"], max_results=500)
    out: dict[str, tuple[float, str]] = {}
    for run in runs:
        stage = run.data.tags.get("pipeline.stage", "")
        if stage in out:
            continue
        end = run.info.end_time or int(time.time() * 1000)
        out[stage] = ((end - run.info.start_time) / 1000,
                      run.data.tags.get("status", "ok" if run.info.status == "FINISHED" else run.info.status.lower()))
    return out
