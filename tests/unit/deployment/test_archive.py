"""Unit: the package stage registers the variant it packages as a new version, moves `@champion` to it, names
both in the `.mar`'s `serving.json`, and puts the pipeline's summary on the parent run (real SQLite store)."""

from __future__ import annotations

import json
import zipfile

import mlflow
import pandas as pd
import pytest

from pipeline.core.io import write_json
from pipeline.core.model_registry import alias_version
from pipeline.core.params import EvaluateParams, MlflowParams, PackageParams, Params, TargetsParams
from pipeline.core.parent_run import start_tracking
from pipeline.deployment import archive as archive_module
from pipeline.deployment.archive import archive_code, run_package_stage, serving_summary
from pipeline.deployment.inference import SentimentPredictor
from pipeline.evaluation.accuracy import log_variant_runs, score_variants
from pipeline.selection import ServedChoice, choose_variant

NAMES = ("fp32-onnx", "int8-dynamic", "int8-static")


def _serving_json(mar) -> dict:
    with zipfile.ZipFile(mar) as archive:
        return json.loads(archive.read("serving.json"))


def test_package_registers_versions_and_moves_the_champion_alias(built, tiny_model_dir, tmp_path, monkeypatch,
                                                                 tracking_store):
    monkeypatch.chdir(tmp_path)
    tracking = MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-package")
    store = tracking.tracking_uri
    context = start_tracking(tracking, run_id="unit-package")  # as each stage process does, once
    dirs = {n: built["dirs"][n] for n in NAMES}
    results = score_variants(tiny_model_dir, dirs, built["tokenized"], EvaluateParams(batch_size=16),
                             targets=TargetsParams())
    log_variant_runs(results, variant_dirs=dirs, finetuned=tiny_model_dir, params=EvaluateParams(),
                     run_context=context, serving=PackageParams())
    write_json(tmp_path / "variants.json", results)
    bench = {name: {"status": "ok", "p50_ms_b1": 10.0 / (i + 1), "speedup_p50_vs_fp32_eager": float(i + 1)}
             for i, name in enumerate(["fp32-eager", *NAMES])}
    write_json(tmp_path / "benchmark.json", bench)
    choice = choose_variant(results, PackageParams(), TargetsParams(), bench)  # as the stage chooses: with timings

    def package(params: Params, tag: str) -> dict:
        return run_package_stage(variants_root=built["root"], variants_metrics=tmp_path / "variants.json",
                                 benchmark_metrics=tmp_path / "benchmark.json", mar=tmp_path / f"{tag}.mar",
                                 manifest_path=tmp_path / f"{tag}.json", params=params, run_context=context)

    first = package(Params(mlflow=tracking), "first")
    _carries_what_the_handler_imports_and_scores_alone(tmp_path / "first.mar", tmp_path / "unpacked")
    served = _serving_json(tmp_path / "first.mar")
    assert served["registered_model"] == first["registered_model"]
    assert served["registered_model"]["uri"] == "models:/imdb-sentiment@champion"
    assert served["registered_model"]["version"] == "1" and served["model"] == f"imdb-sentiment:v1/{choice.name}"
    assert served["registered_model"]["model_id"] == results[choice.name]["model_id"]  # evaluate's model, reused
    assert alias_version("imdb-sentiment", "champion", tracking_uri=store) == "1"
    client = mlflow.MlflowClient()
    assert client.get_model_version("imdb-sentiment", "1").source == f"models:/{results[choice.name]['model_id']}"
    parent = mlflow.get_run(package_runs(client)[0].data.tags["mlflow.parentRunId"])
    assert parent.info.run_id == context.parent_run_id  # evaluate's and package's runs share the parent
    assert parent.data.tags["served_variant"] == choice.name
    assert parent.data.tags["served_model_uri"] == "models:/imdb-sentiment@champion"
    assert parent.data.tags["served_model_version"] == "1"
    assert parent.data.metrics["test_accuracy"] == results["fp32-eager"]["accuracy"]
    assert parent.data.metrics["served_p50_ms"] == bench[choice.name]["p50_ms_b1"]
    assert parent.data.metrics["served_speedup"] == bench[choice.name]["speedup_p50_vs_fp32_eager"]
    assert parent.data.metrics["served_accuracy_delta_pt"] == results[choice.name]["accuracy_delta_pt"]

    # A second run serves fp32-onnx, whose evaluate model is unknown to this store (as after a change of
    # tracking server): it is logged again by the package stage, registered as version 2, and the alias moves.
    write_json(tmp_path / "variants.json", {**results, "fp32-onnx": {**results["fp32-onnx"], "model_id": "m-gone"}})
    second = package(Params(mlflow=tracking, package=PackageParams(variant="fp32-onnx")), "second")
    assert second["model"] == "imdb-sentiment:v2/fp32-onnx"
    assert second["registered_model"]["previous_champion_version"] == "1"
    assert _serving_json(tmp_path / "second.mar")["registered_model"]["version"] == "2"
    assert alias_version("imdb-sentiment", "champion", tracking_uri=store) == "2"
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'imdb-sentiment'")) == ["1", "2"]
    relogged = client.get_logged_model(second["registered_model"]["model_id"])
    assert relogged.name == "fp32-onnx" and relogged.model_id != "m-gone"
    assert mlflow.get_run(relogged.source_run_id).data.tags["pipeline.stage"] == "package"

    # A third whose archive fails: the version it registered is deleted again and the alias stays, so
    # `models:/imdb-sentiment/latest` still names a version that was packaged.
    def fails(*args: object, **kwargs: object) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(archive_module, "build_archive", fails)
    with pytest.raises(OSError, match="no space"):
        package(Params(mlflow=tracking), "third")
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'imdb-sentiment'")) == ["1", "2"]
    assert alias_version("imdb-sentiment", "champion", tracking_uri=store) == "2"
    texts = ["a great film", "an awful film", "fine"]
    got = mlflow.pyfunc.load_model("models:/imdb-sentiment@champion").predict(pd.DataFrame({"text": texts}))
    want = SentimentPredictor(dirs["fp32-onnx"]).predict(texts)
    assert got["label"].tolist() == [p.label for p in want]
    assert got["score"].tolist() == pytest.approx([p.score for p in want], abs=1e-6)


def _carries_what_the_handler_imports_and_scores_alone(mar, into) -> None:
    """The archive's project code is exactly what the handler imports (`archive_code`, the package stage's DVC
    deps), and that is enough: unpacked outside the checkout, in an isolated interpreter (`-I`: no checkout on
    the path), the handler's module imports and its predictor scores a review from the archive's own copy."""
    import subprocess
    import sys

    with zipfile.ZipFile(mar) as archive:
        code = sorted(n for n in archive.namelist() if n.startswith("pipeline/") and not n.endswith("/"))
        archive.extractall(into)
    assert code == [f.as_posix() for f in archive_code()]
    assert "pipeline/evaluation/report.py" not in code and "pipeline/variants/quantize.py" not in code
    probe = (f"import sys; sys.path.insert(0, {str(into)!r}); import handler, pipeline; "
             f"assert pipeline.__file__.startswith({str(into)!r}), pipeline.__file__; "
             "from pathlib import Path; from pipeline.deployment.inference import SentimentPredictor; "
             f"print(SentimentPredictor(Path({str(into)!r}) / 'model').predict(['a great film'])[0].label)")
    proc = subprocess.run([sys.executable, "-I", "-c", probe], cwd=into, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] in ("positive", "negative")


def package_runs(client: mlflow.MlflowClient) -> list:
    """The package stage's runs of this test, oldest first."""
    experiment = client.get_experiment_by_name("unit-package")
    return client.search_runs([experiment.experiment_id], "tags.`pipeline.stage` = 'package'",
                              order_by=["attributes.start_time ASC"])


def test_summary_leaves_out_numbers_a_skipped_benchmark_row_lacks():
    variants = {"fp32-eager": {"accuracy": 0.9}, "int8-static": {"accuracy": 0.89, "accuracy_delta_pt": -1.0,
                                                                  "size_mb": 23.0}}
    registry = {"uri": "models:/imdb-sentiment@champion", "version": "3", "model_id": "m-1"}
    metrics, tags = serving_summary(ServedChoice("int8-static", "why"), variants,
                                    {"int8-static": {"status": "skipped", "reason": "no"}}, registry)
    assert metrics == {"test_accuracy": 0.9, "served_accuracy": 0.89, "served_accuracy_delta_pt": -1.0,
                       "served_size_mb": 23.0}
    assert tags["served_variant"] == "int8-static" and tags["served_model_version"] == "3"




