"""Unit: `benchmarks.tracking_load` counts what its clients really logged: every run it reports is in the store,
ended, with its params and its curve."""

from __future__ import annotations

from benchmarks.tracking_load import EXPERIMENT, measure, table


def test_the_runs_counted_are_the_runs_in_the_store_with_what_a_stage_logs(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    row = measure(uri, clients=2, duration=1.5, metric_batches=2, per_batch=5, margin_s=15.0, label="sqlite file")
    assert row["errors"] == 0, row["first_error"]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], max_results=10_000)
    counted = row["runs"]
    # each client's warm-up run (one metric batch) is in the store too, and runs ended after the window: not counted
    assert counted >= 1 and len(runs) == counted + row["late_runs"] + 2, (counted, row["late_runs"], len(runs))
    timed = [r for r in runs if len(client.get_metric_history(r.info.run_id, "train_loss")) == 10]
    assert len(timed) == counted + row["late_runs"] and row["late_runs"] <= 2  # at most one a client
    assert all(r.info.status == "FINISHED" and len(r.data.params) == 10 for r in runs)
    assert row["calls"] == counted * 5  # create, params and tags, two batches, end
    assert table([row]).splitlines()[-1].startswith(f"| sqlite file | {row['clients']} |")
