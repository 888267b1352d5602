"""Unit: MLflow bookkeeping lives in `pipeline.core.tracking` and `pipeline.core.parent_run` (and the registry's
and served model's modules) alone, and in a real SQLite store: a stage process looks its parent run up once and
passes it down (one search, however much it logs), one run id is one parent and another id another; a tracked
stage records what its work returns (numbers as metrics, statuses and reasons as tags, files as artifacts); the
environment's tracking URI wins over params; the experiment opens as model training; a predictor model loads as
pyfunc and answers like `SentimentPredictor`, with metrics from several runs linked to it; registering adds
versions while the alias moves; the parent run carries the summary and a table; datasets carry digests."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Annotated

import mlflow
import pandas as pd
import pytest
import typer

from pipeline.core.model_registry import alias_version, set_alias
from pipeline.core.params import MlflowParams, Params
from pipeline.core.parent_run import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    VERSION_DONE_TAG,
    VERSION_RUN_TAG,
    log_parent_artifact,
    log_parent_summary,
    log_parent_table,
    resolve_run_context,
    start_tracking,
    tracking_uri,
)
from pipeline.core.stage import StageContext
from pipeline.core.tracking import stage_run, tracked_stage
from tests.factories import ROOT, wait_for_file

TRACKING = ROOT / "pipeline" / "core" / "tracking.py"
PARENT_RUN = ROOT / "pipeline" / "core" / "parent_run.py"
SERVED_MODEL = ROOT / "pipeline" / "deployment" / "mlflow_model.py"
MODEL_REGISTRY = ROOT / "pipeline" / "core" / "model_registry.py"


def _imports_mlflow(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] == "mlflow" or n.endswith("MLFlowLogger")]
    return found


def test_only_the_tracking_registry_and_served_model_modules_talk_to_mlflow():
    owners = (TRACKING, PARENT_RUN, MODEL_REGISTRY, SERVED_MODEL)
    files = [p for d in ("pipeline", "stages", "serving") for p in (ROOT / d).rglob("*.py") if p not in owners]
    assert files and all(_imports_mlflow(p) for p in owners)  # the scan does see an import where there is one
    offenders = [hit for p in files for hit in _imports_mlflow(p)]
    assert offenders == []


def test_tracked_stage_logs_params_metrics_tags_and_artifacts(tmp_path, monkeypatch, tracking_store):
    monkeypatch.chdir(tmp_path)
    params = Params(mlflow=_store(tracking_store(tmp_path / "mlflow.db")))
    report_file = tmp_path / "report.json"
    report_file.write_text("{}")
    report = {"tensorrt-fp16": {"status": "skipped", "reason": "no CUDA"}, "size": {"mb": 2.5}, "flag": True}
    tracked_stage(start_tracking(params.mlflow, run_id="unit-tracking"), params=params, stage="probe",
                  sections=("tensorrt",), body=lambda: report, artifacts=(report_file,))
    runs = mlflow.search_runs(experiment_names=["unit"], filter_string="tags.`pipeline.stage` = 'probe'",
                              output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics == {"size.mb": 2.5}  # booleans are not metrics
    assert run.data.tags["tensorrt-fp16.status"] == "skipped"
    assert run.data.tags["tensorrt-fp16.reason"] == "no CUDA"
    assert run.data.params["tensorrt.max_batch"] == str(params.tensorrt.max_batch)
    parent = run.data.tags["mlflow.parentRunId"]
    assert mlflow.get_run(parent).data.tags["pipeline.role"] == "parent"
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)]
    assert artifacts == ["report.json"]


def test_a_new_experiments_artifacts_sit_beside_its_sqlite_store_whatever_the_working_directory(tmp_path,
                                                                                                   monkeypatch,
                                                                                                   tracking_store):
    elsewhere, store = tmp_path / "elsewhere", tmp_path / "store"
    elsewhere.mkdir()
    store.mkdir()
    monkeypatch.chdir(elsewhere)
    params = Params(mlflow=_store(tracking_store(store / "mlflow.db")))
    report_file = tmp_path / "report.json"
    report_file.write_text("{}")
    tracked_stage(start_tracking(params.mlflow, run_id="unit-artifacts"), params=params, stage="probe",
                  sections=(), body=lambda: {}, artifacts=(report_file,))
    assert list((store / "mlruns").rglob("report.json")) and not list(elsewhere.iterdir())


def _store(uri: str) -> MlflowParams:
    return MlflowParams(tracking_uri=uri, experiment="unit")


def busy_stage(stage: StageContext, report: Annotated[Path, typer.Option(help="a file for the parent run")]) -> None:
    """A stage body that logs as much as the benchmark stage does: a child run per variant, then the parent run's
    table, summary and files, all through the context its stage resolved."""
    for name in ("a", "b", "c"):
        with stage_run(stage.run_context, "benchmark", run_name=f"bench-{name}", tags={"variant": name}) as run:
            run.log_metrics({"p50_ms_b1": 1.0}, run_only=True)
    log_parent_table(stage.run_context, rows=[{"variant": "a", "p50": 1.0}], artifact_file="comparison/t.json")
    log_parent_summary(stage.run_context, metrics={"served_p50_ms": 1.0}, tags={"served_variant": "a"})
    for _ in range(4):
        log_parent_artifact(stage.run_context, report, artifact_path="comparison")


def test_a_stage_process_looks_its_parent_run_up_once_and_points_mlflow_once(tmp_path, monkeypatch, tracking_store):
    """However many runs and parent-run writes a stage makes, its process searches the store twice, for the parent
    and for runs a killed stage left RUNNING, and sets MLflow's tracking URI once (where the stage starts), and
    never sets an experiment globally."""
    from pipeline.core.stage import stage_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_RUN_ID", "unit-once")
    store = tracking_store(tmp_path / "mlflow.db")
    (tmp_path / "params.yaml").write_text(f"mlflow:\n  tracking_uri: {store}\n  experiment: unit-once\n")
    (tmp_path / "report.md").write_text("# report\n")
    calls = {"search_runs": 0, "set_tracking_uri": 0, "set_experiment": 0}
    search_runs, set_tracking_uri = mlflow.MlflowClient.search_runs, mlflow.set_tracking_uri

    def counted_search(self, *args, **kwargs):
        calls["search_runs"] += 1
        return search_runs(self, *args, **kwargs)

    def counted_set_uri(uri):
        calls["set_tracking_uri"] += 1
        return set_tracking_uri(uri)

    def no_set_experiment(*args, **kwargs):
        calls["set_experiment"] += 1

    monkeypatch.setattr(mlflow.MlflowClient, "search_runs", counted_search)
    monkeypatch.setattr(mlflow, "set_tracking_uri", counted_set_uri)
    monkeypatch.setattr(mlflow, "set_experiment", no_set_experiment)
    stage_main("busy", busy_stage, ["--params", "params.yaml", "--report", "report.md"])
    assert calls == {"search_runs": 2, "set_tracking_uri": 1, "set_experiment": 0}

    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("unit-once")
    runs = search_runs(client, [experiment.experiment_id], "tags.`pipeline.run_id` = 'unit-once'")
    parents = [r for r in runs if r.data.tags["pipeline.role"] == "parent"]
    children = [r for r in runs if r.data.tags["pipeline.role"] == "stage"]
    assert len(parents) == 1 and len(children) == 3
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert parents[0].data.tags["served_variant"] == "a"
    assert len(client.list_artifacts(parents[0].info.run_id, "comparison")) == 2  # report.md and the table


def test_a_stage_run_whose_process_died_is_ended_killed_by_the_next_stage_process(tmp_path, monkeypatch,
                                                                                     tracking_store):
    """A SIGKILL'd stage leaves its run RUNNING; the next stage process on the host ends it KILLED, naming itself,
    and deletes the registered version the dead run left unfinished and without an alias (a package stage killed
    before its alias moved; one the alias reached stays, and so does one it finished), and leaves alone a RUNNING
    run whose process is alive (a stage running beside it) and its versions."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    params = _store(tracking_store(tmp_path / "mlflow.db"))
    context = start_tracking(params, run_id="unit-orphan-1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    runs, versions = {}, {}
    for name, pid in (("killed", dead.stdout.strip()), ("alive", str(os.getpid()))):
        with stage_run(context, name) as run:
            runs[name] = run.run_id
            ref = run.log_external_model(name, tmp_path)
            # what a kill inside `StageRun.registering` leaves: versions of the run, the newest without an alias;
            # before it, one it finished whose alias another run has moved on since
            tags = {VERSION_RUN_TAG: run.run_id}
            done = mlflow.register_model(ref.uri, "reg", tags={**tags, VERSION_DONE_TAG: "true"})
            versions[name] = [str(done.version),
                              *(str(mlflow.register_model(ref.uri, "reg", tags=tags).version) for _ in range(2))]
            set_alias("reg", name, versions[name][1], tracking_uri=params.tracking_uri)
        client = context.client()
        client.set_tag(run.run_id, "pipeline.pid", pid)
        client.update_run(run.run_id, status="RUNNING")  # as a process killed inside the stage leaves it
    later = start_tracking(params, run_id="unit-orphan-2")
    killed, alive = (later.client().get_run(runs[n]) for n in ("killed", "alive"))
    assert killed.info.status == "KILLED" and killed.data.tags["pipeline.closed_as_orphan_by"] == "unit-orphan-2"
    assert alive.info.status == "RUNNING"
    left = sorted(str(v.version) for v in later.client().search_model_versions("name = 'reg'"))
    assert left == sorted([*versions["killed"][:2], *versions["alive"]]), (left, versions)


def test_one_run_id_is_one_parent_run_and_another_run_id_another(tmp_path, monkeypatch, tracking_store):
    """Resolving a context finds the parent of its run id or creates it, through a client on the params' store:
    MLflow's process-wide tracking URI and the environment are left as they were."""
    monkeypatch.chdir(tmp_path)
    params = _store(tracking_store(tmp_path / "mlflow.db"))
    environment, global_uri = dict(os.environ), mlflow.get_tracking_uri()
    first = resolve_run_context(params, run_id="exec-1")
    again = resolve_run_context(params, run_id="exec-1")
    other = resolve_run_context(params, run_id="exec-2")
    assert dict(os.environ) == environment and mlflow.get_tracking_uri() == global_uri
    assert again == first and first.tracking_uri == params.tracking_uri and first.run_id == "exec-1"
    assert other.parent_run_id != first.parent_run_id and other.experiment_id == first.experiment_id
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    parents = client.search_runs([first.experiment_id], "tags.`pipeline.role` = 'parent'")
    assert sorted((r.data.tags["pipeline.run_id"], r.info.run_name) for r in parents) == [
        ("exec-1", "pipeline-exec-1"), ("exec-2", "pipeline-exec-2")]
    assert {r.info.status for r in parents} == {"FINISHED"}


def test_the_environment_names_the_tracking_store_and_the_experiment_opens_as_model_training(tmp_path, monkeypatch,
                                                                                             tracking_store):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_store(tmp_path / "from-env.db"))
    params = _store(f"sqlite:///{tmp_path / 'from-params.db'}")
    assert tracking_uri(params) == f"sqlite:///{tmp_path / 'from-env.db'}"
    with stage_run(start_tracking(params, run_id="unit-env"), "probe") as run:
        run.log_metrics({"x": 1.0})
    assert not (tmp_path / "from-params.db").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'from-env.db'}")
    experiment = client.get_experiment_by_name("unit")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert client.get_run(run.run_id).data.metrics == {"x": 1.0}
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri(params) == params.tracking_uri


def test_a_predictor_model_loads_as_pyfunc_and_answers_like_the_predictor(tmp_path, monkeypatch, tiny_model_dir,
                                                                           tracking_store):
    from pipeline.deployment.inference import SentimentPredictor
    from pipeline.deployment.mlflow_model import EXAMPLE_REVIEWS, local_model, log_predictor_model, runtime_requirements

    monkeypatch.chdir(tmp_path)
    context = start_tracking(_store(tracking_store(tmp_path / "mlflow.db")), run_id="unit-model")
    with stage_run(context, "evaluate", run_name="fp32-eager") as run:
        ref = log_predictor_model(run, "fp32-eager", tiny_model_dir, SentimentPredictor, examples=EXAMPLE_REVIEWS,
                                  model_config={"max_chars": 64, "threads": 1},
                                  requirements=runtime_requirements("eager"),
                                  params={"heads": 12}, tags={"variant": "fp32-eager"}, model_type="eager")
        run.log_metrics({"accuracy": 0.75, "note": "text is skipped"}, model_id=ref.model_id)
    with stage_run(context, "benchmark") as other:
        other.log_metrics({"p50_ms_b1": 4.5}, model_id=ref.model_id)
    assert ref.uri == f"models:/{ref.model_id}" and ref.files
    client = mlflow.MlflowClient()
    model = client.get_logged_model(ref.model_id)
    assert model.name == "fp32-eager" and model.source_run_id == run.run_id and model.model_type == "eager"
    assert model.params == {"heads": "12"} and model.tags["variant"] == "fp32-eager"
    assert {(m.key, m.value, m.run_id) for m in model.metrics} == {("accuracy", 0.75, run.run_id),
                                                                   ("p50_ms_b1", 4.5, other.run_id)}
    texts = ["a great and wonderful film", "awful, boring and far too long " * 20, "ok"]
    loaded = mlflow.pyfunc.load_model(ref.uri)
    assert loaded.metadata.signature.inputs.input_names() == ["text"]
    assert loaded.metadata.get_input_schema().to_dict() == [{"type": "string", "name": "text", "required": True}]
    assert [c["name"] for c in loaded.metadata.get_output_schema().to_dict()] == ["label", "score"]
    assert loaded.metadata.get_model_info().saved_input_example_info is not None
    got = loaded.predict(pd.DataFrame({"text": texts}))
    want = SentimentPredictor(tiny_model_dir, max_chars=64).predict(texts)
    assert got["label"].tolist() == [p.label for p in want]
    assert got["score"].tolist() == pytest.approx([p.score for p in want], abs=1e-6)
    requirements = Path(mlflow.pyfunc.get_model_dependencies(ref.uri)).read_text()
    assert "torch==" in requirements and "mlflow==" in requirements
    # the server's way in: the model by id, found through the store it is given, not MLflow's global one
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.setattr(tracking_utils, "_tracking_uri", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    assert (Path(local_model(ref.uri, tracking_uri=context.tracking_uri)) / "MLmodel").is_file()
    assert not (tmp_path / "elsewhere.db").exists()


def test_registering_adds_versions_and_the_alias_moves(tmp_path, monkeypatch, tiny_model_dir, tracking_store):
    monkeypatch.chdir(tmp_path)
    params = _store(tracking_store(tmp_path / "mlflow.db"))
    store = params.tracking_uri
    context = start_tracking(params, run_id="unit-registry")
    versions, runs = [], []
    for round_ in range(2):
        with stage_run(context, "package") as run:
            runs.append(run.run_id)
            ref = run.log_external_model(f"m{round_}", tiny_model_dir)
            assert alias_version("reg", "champion", tracking_uri=store) == (versions[-1] if versions else None)
            with run.registering("reg", ref.uri, "unit", {"round": round_}) as version:
                set_alias("reg", "champion", version, tracking_uri=store)
            versions.append(version)
    assert versions == ["1", "2"] and alias_version("reg", "champion", tracking_uri=store) == "2"
    client = mlflow.MlflowClient()
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'reg'")) == ["1", "2"]
    done = {VERSION_RUN_TAG: runs[0], VERSION_DONE_TAG: "true"}
    assert client.get_model_version("reg", "1").tags == {"round": "0", **done}
    assert client.get_run(runs[1]).data.tags["registered_model_version"] == "2"
    external = client.get_logged_model(ref.model_id)
    assert not ref.files and external.tags["artifact_pointer"] == str(tiny_model_dir.resolve())


def test_a_version_whose_packaging_fails_is_deleted_unless_an_alias_names_it(tmp_path, monkeypatch, tiny_model_dir,
                                                                            tracking_store):
    """`models:/reg/latest` resolves to the newest version: one registered by a package stage that then failed or
    was stopped (its archive, its alias) is deleted, so it never names an unfinished one. A version the alias
    reached before the failure is kept; so is every finished one."""
    monkeypatch.chdir(tmp_path)
    params = _store(tracking_store(tmp_path / "mlflow.db"))
    store = params.tracking_uri
    context = start_tracking(params, run_id="unit-registry-failed")
    client = context.client()
    with stage_run(context, "package") as run:
        ref = run.log_external_model("m", tiny_model_dir)
        with run.registering("reg", ref.uri, "unit") as done:
            set_alias("reg", "champion", done, tracking_uri=store)
        for stop in (RuntimeError("the archive failed"), KeyboardInterrupt()):
            with pytest.raises(type(stop)), run.registering("reg", ref.uri, "unit") as failed:
                raise stop
            with pytest.raises(mlflow.exceptions.MlflowException) as gone:
                client.get_model_version("reg", failed)
            assert gone.value.error_code == "RESOURCE_DOES_NOT_EXIST"
        with pytest.raises(RuntimeError), run.registering("reg", ref.uri, "unit") as aliased:
            set_alias("reg", "champion", aliased, tracking_uri=store)
            raise RuntimeError("the manifest failed")
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'reg'")) == [done, aliased]
    assert alias_version("reg", "champion", tracking_uri=store) == aliased


def test_parent_run_carries_the_summary_and_the_table(tmp_path, monkeypatch, tracking_store):
    monkeypatch.chdir(tmp_path)
    context = start_tracking(_store(tracking_store(tmp_path / "mlflow.db")), run_id="unit-parent")
    parent = log_parent_summary(context, metrics={"served_p50_ms": 3.5, "test_accuracy": 0.9, "skipped": "text"},
                                tags={"served_variant": "int8-static"})
    log_parent_table(context, rows=[{"variant": "a", "p50": 1.0}, {"variant": "b", "p50": 2.0}],
                     artifact_file="comparison/t.json")
    assert parent == context.parent_run_id
    run = mlflow.get_run(parent)
    assert run.data.tags["pipeline.role"] == "parent" and run.data.tags["served_variant"] == "int8-static"
    assert run.data.metrics == {"served_p50_ms": 3.5, "test_accuracy": 0.9}
    table = mlflow.MlflowClient().load_table(context.experiment_id, "comparison/t.json", run_ids=[parent])
    assert table["variant"].tolist() == ["a", "b"] and table["p50"].tolist() == [1.0, 2.0]


def test_a_logged_dataset_has_a_digest_of_its_content(tmp_path, monkeypatch, tracking_store):
    monkeypatch.chdir(tmp_path)
    frame = pd.DataFrame({"text": ["good", "bad"], "label": [1, 0]})
    context = start_tracking(_store(tracking_store(tmp_path / "mlflow.db")), run_id="unit-data")
    with stage_run(context, "prepare") as run:
        first = run.log_dataset(frame, "imdb-train", "training", str(tmp_path), targets="label")
        second = run.log_dataset(frame.assign(label=[0, 1]), "imdb-test", "test", str(tmp_path), targets="label")
    assert first != second
    inputs = mlflow.get_run(run.run_id).inputs.dataset_inputs
    by_name = {i.dataset.name: i for i in inputs}
    assert by_name["imdb-train"].dataset.digest == first and by_name["imdb-test"].dataset.digest == second
    assert {t.value for t in by_name["imdb-train"].tags if t.key == "mlflow.data.context"} == {"training"}


def test_a_package_stage_stopped_by_sigterm_ends_killed_and_leaves_no_unfinished_version(tmp_path, tiny_model_dir,
                                                                                          tracking_store):
    """SIGTERM while the package stage finishes a registered version (`docker stop`, a scheduler): the stage's own
    cleanup runs (`pipeline.core.stage.sigterm_stops_the_body`), so its run ends KILLED at once and the version is
    deleted, not left for whichever stage process starts next."""
    import signal
    import subprocess
    import sys
    import textwrap

    store = tracking_store(tmp_path / "mlflow.db")
    started = tmp_path / "registered"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from pipeline.core.params import MlflowParams
        from pipeline.core.parent_run import start_tracking
        from pipeline.core.stage import run_stage
        from pipeline.core.tracking import stage_run

        def body():
            context = start_tracking(MlflowParams(tracking_uri={store!r}, experiment="unit"), run_id="unit-term")
            with stage_run(context, "package") as run:
                ref = run.log_external_model("m", Path({str(tiny_model_dir)!r}))
                with run.registering("reg", ref.uri, "unit"):
                    Path({str(started)!r}).touch()
                    time.sleep(120)

        run_stage(name="package", body=body, run_id="unit-term")
    """)
    err_file = tmp_path / "stderr.txt"  # a file, not a pipe nobody reads while waiting: MLflow logs a lot
    with err_file.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stderr=err,
                                env={**os.environ, "PIPELINE_STAGE_LOG": str(tmp_path / "stages.jsonl")})
    try:
        assert wait_for_file(started, proc, 120), err_file.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err_file.read_text()[-3000:]
    client = mlflow.MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("unit").experiment_id],
                               filter_string="tags.`pipeline.stage` = 'package'")
    assert run.info.status == "KILLED"
    assert client.search_model_versions("name = 'reg'") == []


def test_a_registration_stopped_inside_the_registry_call_leaves_no_version(tmp_path, monkeypatch, tiny_model_dir,
                                                                          tracking_store):
    """Ctrl-C (or SIGTERM) can arrive after the store created the version but before `register_model` returned its
    number: the version, found by its run's tag, is deleted too."""
    monkeypatch.chdir(tmp_path)
    params = _store(tracking_store(tmp_path / "mlflow.db"))
    context = start_tracking(params, run_id="unit-registry-interrupted")
    real = mlflow.register_model

    def created_then_interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    with stage_run(context, "package") as run:
        ref = run.log_external_model("m", tiny_model_dir)
        with run.registering("reg", ref.uri, "unit") as done:
            pass
        monkeypatch.setattr(mlflow, "register_model", created_then_interrupted)
        with pytest.raises(KeyboardInterrupt), run.registering("reg", ref.uri, "unit"):
            pass
        monkeypatch.setattr(mlflow, "register_model", real)
    assert [str(v.version) for v in context.client().search_model_versions("name = 'reg'")] == [done]
