"""Unit: every variant scored the same way (accuracy, agreement with FP32, size), reusing the finetune logits, and
logged as an MLflow model with those scores linked to it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.core.io import write_predictions
from pipeline.core.params import EvaluateParams, TargetsParams
from pipeline.data.tokens import read_tokenized
from pipeline.deployment.protocol import RequestError
from pipeline.evaluation.accuracy import check_targets, score_variants
from pipeline.runtimes.base import predict_logits
from pipeline.runtimes.fp32_linear import fp32_linear_on
from pipeline.runtimes.record import VariantError
from pipeline.runtimes.registry import load_runner


def test_scores_and_sizes(built, tiny_model_dir):
    results = score_variants(tiny_model_dir, built["dirs"], built["tokenized"], EvaluateParams(batch_size=16),
                             targets=TargetsParams())
    assert results["fp32-onnx"]["agreement_with_fp32"] == 1.0
    assert results["fp32-torchscript"]["accuracy"] == results["fp32-eager"]["accuracy"]
    # agreement is the share of test reviews on which a variant's label is FP32's, recomputed here from the
    # runners. The random tiny BERT gives (nearly) every review the same label, so its accuracy is about 0.5
    # while the INT8 variants agree with it on (nearly) every review: scoring agreement against the labels
    # instead of against FP32 would fail here.
    seqs = read_tokenized(built["tokenized"], "test")["input_ids"].tolist()
    fp32 = predict_logits(load_runner(tiny_model_dir), seqs, 16).argmax(-1)
    for name in ("int8-dynamic", "int8-static", "int8-qat"):
        assert results[name]["size_mb"] < 0.35 * results["fp32-onnx"]["size_mb"]
        int8 = predict_logits(load_runner(built["dirs"][name]), seqs, 16).argmax(-1)
        assert results[name]["agreement_with_fp32"] == float((int8 == fp32).mean()), name
        assert results[name]["agreement_with_fp32"] >= 0.9, (name, results[name])  # 1.0 measured
        labels = read_tokenized(built["tokenized"], "test")["label"].to_numpy()
        only_fp32 = int(((fp32 == labels) & (int8 != labels)).sum()) + 0.5
        only_int8 = int(((int8 == labels) & (fp32 != labels)).sum()) + 0.5
        m = len(labels) + 2
        se = 100 * np.sqrt(only_fp32 + only_int8 - (only_int8 - only_fp32) ** 2 / m) / m
        assert results[name]["accuracy_delta_se_pt"] == pytest.approx(se, abs=1e-4), name
    assert results["tensorrt-fp16"]["status"] == "skipped"
    # each INT8 candidate is paired with the most accurate one on the same reviews (the package stage's tie rule)
    from pipeline.selection import int8_candidates, mcnemar_p, most_accurate

    candidates = int8_candidates(results, TargetsParams())
    best = most_accurate(candidates)
    assert best is not None
    assert results[best]["paired_only_this_right"] == 0 == results[best]["paired_only_reference_right"]
    for name in candidates:
        e = results[name]
        assert e["paired_reference"] == best
        assert e["paired_p_value"] == mcnemar_p(e["paired_only_reference_right"], e["paired_only_this_right"])
    # int8-qat against int8-static on the same reviews, as the target "QAT at least matches static" is judged
    static = predict_logits(load_runner(built["dirs"]["int8-static"]), seqs, 16).argmax(-1) == labels
    qat = predict_logits(load_runner(built["dirs"]["int8-qat"]), seqs, 16).argmax(-1) == labels
    q = results["int8-qat"]
    assert (q["vs_static_only_static_right"], q["vs_static_only_qat_right"]) == (int((static & ~qat).sum()),
                                                                                 int((qat & ~static).sum()))
    assert q["vs_static_p_value"] == mcnemar_p(q["vs_static_only_static_right"], q["vs_static_only_qat_right"])

    lines = check_targets(results, TargetsParams())
    assert any("int8-static" in line for line in lines)


@pytest.mark.parametrize("only_static, only_qat, said", [
    (12, 10, "a tie the test set cannot resolve: exact McNemar p = 0.83 >= 0.05"),  # the Zen 3 run of 11-29
    (30, 5, "MISSED: QAT at least matches static"),  # p < 0.001: a real difference
    (5, 7, "met: QAT at least matches static"),
])
def test_qat_below_static_by_a_difference_the_test_set_cannot_resolve_is_a_tie_not_a_miss(only_static, only_qat, said):
    """1,500 reviews of which both get 1,300 right, plus the reviews only one of them gets right."""
    from pipeline.evaluation.accuracy import paired_qat_with_static

    n, both = 1500, 1300
    static = np.zeros(n, bool)
    qat = np.zeros(n, bool)
    static[:both + only_static] = True
    qat[:both] = True
    qat[both + only_static:both + only_static + only_qat] = True
    results = {"fp32-eager": {"status": "ok", "accuracy": static.mean()},
               "int8-static": {"status": "ok", "accuracy": float(static.mean()), "size_mb": 1.0},
               "int8-qat": {"status": "ok", "accuracy": float(qat.mean()), "size_mb": 1.0}}
    paired_qat_with_static(results, {"int8-static": static, "int8-qat": qat})
    line = next(x for x in check_targets(results, TargetsParams()) if x.startswith("int8-qat "))
    assert said in line, line


def test_the_paired_standard_error_comes_from_the_disagreements_and_is_never_zero():
    """From the reviews only one of the two gets right, with Agresti and Min's half review per cell: four reviews
    that only FP32 gets right in 1,500 (-0.27 pt) give about 0.15 pt; no disagreement still leaves about one
    review's worth (0.07 pt), not a certainty; more disagreements, more error."""
    from pipeline.evaluation.accuracy import paired_se_pt

    reference = np.ones(1500, dtype=bool)
    this = reference.copy()
    this[:4] = False
    assert paired_se_pt(this, reference) == pytest.approx(100 * np.sqrt(5 - 16 / 1502) / 1502, abs=1e-4)
    assert 0.14 < paired_se_pt(this, reference) < 0.15
    assert paired_se_pt(reference.copy(), reference) == pytest.approx(100 / 1502, abs=1e-4)
    swapped = this.copy()
    swapped[4:8] = False
    reference_wrong = reference.copy()
    reference_wrong[8:12] = False
    assert paired_se_pt(swapped, reference_wrong) > paired_se_pt(this, reference)
    assert paired_se_pt(np.array([], dtype=bool), np.array([], dtype=bool)) == 0.0


def test_reference_row_reuses_the_finetune_logits_only_for_the_same_split(built, tiny_model_dir, tmp_path):
    params = EvaluateParams(batch_size=16)
    test = read_tokenized(built["tokenized"], "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    logits = predict_logits(load_runner(tiny_model_dir), seqs, 16)
    saved = tmp_path / "finetune-test.npz"
    kernel = fp32_linear_on("cpu")
    write_predictions(saved, logits, labels, seqs, seconds=1.5, batch_size=16, device="cpu", pad_id=0,
                      fp32_linear=kernel)
    fresh = score_variants(tiny_model_dir, {"fp32-onnx": built["dirs"]["fp32-onnx"]}, built["tokenized"], params,
                           targets=TargetsParams())
    reused = score_variants(tiny_model_dir, {"fp32-onnx": built["dirs"]["fp32-onnx"]}, built["tokenized"], params,
                            reference_predictions=saved, targets=TargetsParams())
    assert fresh["fp32-eager"]["scored_by"] == "evaluate" and reused["fp32-eager"]["scored_by"] == "finetune"
    for name in ("fp32-eager", "fp32-onnx"):
        assert reused[name]["accuracy"] == fresh[name]["accuracy"]
        assert reused[name]["agreement_with_fp32"] == fresh[name]["agreement_with_fp32"]
    assert reused["fp32-eager"]["eval_seconds"] == 1.5
    # scored differently: scored again
    other_batches = score_variants(tiny_model_dir, {}, built["tokenized"], EvaluateParams(batch_size=8),
                                   reference_predictions=saved, targets=TargetsParams())
    assert other_batches["fp32-eager"]["scored_by"] == "evaluate"
    assert other_batches["fp32-eager"]["accuracy"] == fresh["fp32-eager"]["accuracy"]
    other_kernel = "torch" if kernel == "onednn" else "onednn"
    for meta in ({"device": "cuda", "pad_id": 0, "fp32_linear": kernel}, {"device": "cpu", "pad_id": 1,
                 "fp32_linear": kernel}, {"device": "cpu", "pad_id": 0, "fp32_linear": other_kernel},
                 {"device": "cpu", "pad_id": 0}, {}):  # or another device, padding, FP32 kernel, or not recorded
        elsewhere = tmp_path / "elsewhere.npz"
        write_predictions(elsewhere, logits, labels, seqs, seconds=1.5, batch_size=16, **meta)
        again = score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=elsewhere,
                               targets=TargetsParams())
        assert again["fp32-eager"]["scored_by"] == "evaluate", meta

    stale = tmp_path / "stale.npz"  # same reviews, one label changed: a different test split
    write_predictions(stale, logits, np.where(np.arange(len(labels)) == 0, 1 - labels, labels), seqs)
    with pytest.raises(VariantError, match="different test split"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=stale,
                       targets=TargetsParams())
    other = tmp_path / "other.npz"  # one token changed
    write_predictions(other, logits, labels, [seqs[0][:-1], *seqs[1:]])
    with pytest.raises(VariantError, match="stale predictions"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=other,
                       targets=TargetsParams())
    with pytest.raises(VariantError, match="not found"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=tmp_path / "none.npz",
                       targets=TargetsParams())


def test_every_built_variant_is_an_mlflow_model_with_its_scores(built, tiny_model_dir, tmp_path, monkeypatch,
                                                                 tracking_store):
    """Deployable variants within `evaluate.artifact_max_mb` are pyfunc models holding their files; larger ones,
    the FP32 reference and GPU-only variants are external models; skipped variants get none. Each model carries
    its variant's scores, and each entry the model's id."""
    import mlflow

    from pipeline.core.params import MlflowParams, PackageParams
    from pipeline.core.parent_run import start_tracking
    from pipeline.evaluation.accuracy import log_variant_runs

    monkeypatch.chdir(tmp_path)
    tracking = MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-evaluate")
    dirs = {n: built["dirs"][n] for n in ("fp32-onnx", "int8-static", "tensorrt-fp16")}
    results = score_variants(tiny_model_dir, dirs, built["tokenized"], EvaluateParams(batch_size=16),
                             targets=TargetsParams())
    limit = (results["fp32-onnx"]["size_mb"] + results["int8-static"]["size_mb"]) / 2  # fp32-onnx is above it
    log_variant_runs(results, variant_dirs=dirs, finetuned=tiny_model_dir, params=EvaluateParams(artifact_max_mb=limit),
                     run_context=start_tracking(tracking, run_id="unit-evaluate"),
                     serving=PackageParams(max_chars_per_text=100))
    experiment = mlflow.get_experiment_by_name("unit-evaluate")
    models = {m.name: m for m in mlflow.search_logged_models(experiment_ids=[experiment.experiment_id],
                                                               output_format="list")}
    assert set(models) == {"fp32-eager", "fp32-onnx", "int8-static"}  # tensorrt-fp16 was skipped (no CUDA)
    assert "model_id" not in results["tensorrt-fp16"]
    for name, model in models.items():
        assert results[name]["model_id"] == model.model_id
        metrics = {m.key: m.value for m in model.metrics}
        assert metrics["accuracy"] == results[name]["accuracy"]
        assert metrics["agreement_with_fp32"] == results[name]["agreement_with_fp32"]
        assert metrics["size_mb"] == results[name]["size_mb"]
        assert "eval_seconds" not in metrics  # bookkeeping stays on the run, out of the models view
        assert mlflow.get_run(model.source_run_id).data.metrics["eval_seconds"] == results[name]["eval_seconds"]
        assert model.tags["variant"] == name
    assert [results[n]["model_files"] for n in ("fp32-eager", "fp32-onnx", "int8-static")] == [False, False, True]
    assert models["fp32-onnx"].tags["artifact_pointer"] == str(dirs["fp32-onnx"].resolve())
    assert models["int8-static"].model_type == "onnx-int8"
    loaded = mlflow.pyfunc.load_model(results["int8-static"]["model_uri"])
    assert loaded.model_config == {"max_chars": 100, "threads": None}  # no request limit in the model
    from pipeline.deployment.inference import SentimentPredictor

    texts = ["great wonderful film", "awful boring film"]
    want = SentimentPredictor(dirs["int8-static"], max_chars=100).predict(texts)
    assert loaded.predict(pd.DataFrame({"text": texts}))["label"].tolist() == [p.label for p in want]
    corpus = [f"{t} #{i}" for i in range(150) for t in texts]  # 300 rows: more than a request may hold
    scored = loaded.predict(pd.DataFrame({"text": corpus}))
    assert len(scored) == 300 and scored["label"].tolist() == [p.label for p in want] * 150
    frame = pd.DataFrame({"text": texts * 2}, index=[10, 3, "x", 0])  # the caller's index is the answers'
    joined = frame.join(loaded.predict(frame))
    assert joined["label"].tolist() == [p.label for p in want] * 2 and joined["score"].notna().all()
    assert loaded.predict(frame.set_axis([5, 5, 5, 5])).index.tolist() == [5, 5, 5, 5]  # duplicates too
    with pytest.raises(RequestError, match=r"text\[0\] must be a string, got a list: MLflow reads a dict of lists"):
        loaded.predict({"text": texts})  # MLflow's one row holding a list, not two rows
    # a packaged thread count never above the loading process's cap (a Spark task's cores, handed on as the cap)
    import pipeline.deployment.inference as inference

    asked: list[int | None] = []
    real_load_runner = inference.load_runner
    monkeypatch.setattr(inference, "load_runner",
                        lambda d, threads, **kw: (asked.append(threads), real_load_runner(d, threads, **kw))[1])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mlflow.pyfunc.load_model(results["int8-static"]["model_uri"], model_config={"threads": 4})
    monkeypatch.delenv("OMP_NUM_THREADS")
    mlflow.pyfunc.load_model(results["int8-static"]["model_uri"], model_config={"threads": 4})
    assert asked == [1, 4]


def test_concurrent_callers_score_every_batch_once_with_the_same_logits():
    """`predict_logits(callers=2)`: two threads call the runner at the same time (a barrier both must reach proves
    the overlap), every review is scored exactly once, and the logits come back in input order."""
    import threading

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 500, size=int(n)) for n in rng.integers(3, 40, size=37)]
    meet = threading.Barrier(2, timeout=30)
    waited: set[str] = set()
    seen: list[int] = []
    lock = threading.Lock()

    def runner(ids, mask):
        name = threading.current_thread().name
        if name.startswith("score") and name not in waited:  # each calling thread's first call meets the other's
            waited.add(name)
            meet.wait()
        with lock:
            seen.extend(int(r) for r in ids[:, 0])
        lengths = mask.sum(1)
        return np.stack([ids[:, 0] * 1.0, lengths * 1.0], axis=1).astype(np.float32)

    alone = predict_logits(runner, seqs, 4)
    seen.clear()
    together = predict_logits(runner, seqs, 4, callers=2)  # a barrier neither thread could pass alone
    assert len(waited) == 2 and not meet.broken  # both callers were inside the runner at once
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(together[:, 1], [len(s) for s in seqs])
    assert sorted(seen) == sorted(int(s[0]) for s in seqs)  # every review once


def test_a_rows_variant_is_scored_by_one_thread_calls_on_every_core(built, tiny_model_dir, monkeypatch):
    """A variant scored one review per call gets `threads` one-thread calls at once, recorded with its result;
    its labels are those of the default runner."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = score_variants(tiny_model_dir, {"int8-dynamic": built["dirs"]["int8-dynamic"]}, built["tokenized"],
                             EvaluateParams(batch_size=16, threads=2), targets=TargetsParams())
    used = results["int8-dynamic"]["scored_with"]
    assert used["batching"] == "rows" and used["threads"] == 1 and used["concurrent_calls"] == 2
    seqs = read_tokenized(built["tokenized"], "test")["input_ids"].tolist()
    labels = read_tokenized(built["tokenized"], "test")["label"].to_numpy()
    pred = predict_logits(load_runner(built["dirs"]["int8-dynamic"], 2), seqs, 16).argmax(-1)
    assert results["int8-dynamic"]["accuracy"] == float((pred == labels).mean())


def test_rows_are_scored_by_parallel_callers_only_where_the_runtime_runs_calls_side_by_side(built):
    """On two cores an onnxruntime variant scored by rows gets two one-thread callers; the OpenVINO INT8 IR, also
    scored by rows, gets two callers on two streams of one thread each (on its served one stream they would only
    take turns); a batched variant, or one core, keeps one caller."""
    from pipeline.evaluation.accuracy import runner_for_test_split

    dirs = built["dirs"]
    runner, callers = runner_for_test_split(dirs["int8-dynamic"], threads=2)
    assert callers == 2 and runner.rows_alone
    runner, callers = runner_for_test_split(dirs["int8-openvino"], threads=2)
    assert callers == 2 and runner.rows_alone and runner.describe()["streams"] == 2
    runner, callers = runner_for_test_split(dirs["int8-openvino"], threads=1)
    assert callers == 1 and runner.describe()["streams"] == 1
    assert runner_for_test_split(dirs["fp32-onnx"], threads=2)[1] == 1
    assert runner_for_test_split(dirs["int8-dynamic"], threads=1)[1] == 1


@pytest.mark.parametrize("variant", ["int8-openvino", "int8-dynamic"])
def test_the_test_split_scored_by_parallel_callers_gets_the_served_runners_logits(built, variant):
    """What evaluate's parallel callers score (`runner_for_test_split`: one-thread calls side by side, OpenVINO on
    two streams) is what the runner a server loads scores, review by review: the same labels and logits within the
    batch-invariance contract (1e-4)."""
    from pipeline.evaluation.accuracy import runner_for_test_split

    seqs = read_tokenized(built["tokenized"], "test")["input_ids"].tolist()
    runner, callers = runner_for_test_split(built["dirs"][variant], threads=2)
    assert callers == 2
    parallel = predict_logits(runner, seqs, 16, callers=callers)
    served = predict_logits(load_runner(built["dirs"][variant], 2), seqs, 16)
    assert (parallel.argmax(-1) == served.argmax(-1)).all()
    assert float(np.abs(parallel - served).max()) <= 1e-4


def test_log_variant_runs_names_the_formats_and_the_predictor_it_logs():
    """Its docstring says what the code does: every format `servable` admits (OpenVINO included) is logged around
    the predictor `log_variant_model` wraps (once documented as ONNX and TorchScript around SentimentPredictor)."""
    import inspect
    import re

    from pipeline.deployment import mlflow_model
    from pipeline.evaluation.accuracy import log_variant_runs
    from pipeline.runtimes.catalog import VARIANTS

    doc = inspect.getdoc(log_variant_runs) or ""
    servable = {v.format for v in VARIANTS if v.servable}
    assert servable == {"torchscript", "onnx", "openvino"} and all(fmt in doc for fmt in servable)
    wrapped = re.search(r"import (\w+Predictor)", inspect.getsource(mlflow_model.log_variant_model))
    assert wrapped is not None and f"`{wrapped.group(1)}`" in doc


def test_the_reference_row_scores_the_fp32_model_where_no_finetune_logits_are_given(built, tiny_model_dir):
    """`reference_row` (the FP32 block of `score_variants`): the entry `score_variants` records for FP32 eager, and
    the labels every variant's agreement is counted against."""
    from pipeline.evaluation.accuracy import reference_row

    test = read_tokenized(built["tokenized"], "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    entry, predicted = reference_row(tiny_model_dir, seqs, labels, EvaluateParams(batch_size=16), None, 0)
    assert predicted.shape == labels.shape and entry["accuracy"] == float((predicted == labels).mean())
    assert (entry["scored_by"], entry["test_samples"], entry["agreement_with_fp32"]) == ("evaluate", len(labels), 1.0)
    scored = score_variants(tiny_model_dir, {}, built["tokenized"], EvaluateParams(batch_size=16),
                            targets=TargetsParams())["fp32-eager"]
    assert {k: v for k, v in scored.items() if k != "eval_seconds"} == {
        **{k: v for k, v in entry.items() if k != "eval_seconds"}, "accuracy_delta_pt": 0.0}


def test_a_fault_in_a_runner_keeps_its_traceback_and_names_the_variant(built, tiny_model_dir, monkeypatch):
    """A bug (not a variant the user can fix) is not turned into a one-line user error: the original exception
    propagates, with a note naming the variant, so the stage shows its traceback."""
    from pipeline.evaluation import accuracy

    def broken(*args, **kwargs):
        raise TypeError("a bug in a runner")

    monkeypatch.setattr(accuracy, "runner_for_test_split", broken)
    with pytest.raises(TypeError, match="a bug in a runner") as info:
        score_variants(tiny_model_dir, {"fp32-onnx": built["dirs"]["fp32-onnx"]}, built["tokenized"],
                       EvaluateParams(batch_size=16), targets=TargetsParams())
    assert info.value.__notes__ == ["variant fp32-onnx failed to run on the test split"]


def test_the_recorded_p_value_is_not_rounded_across_the_tie_threshold():
    """150 against 117 reviews only one variant gets right: p = 0.04998, a difference the test set resolves.
    Rounded to 4 decimals it read 0.05, at the package stage's tie threshold, and counted as a tie."""
    from pipeline.evaluation.accuracy import discordant
    from pipeline.selection import TIE_P_VALUE

    first = np.array([True] * 150 + [False] * 117)
    _, _, p = discordant(first, ~first)
    assert p < TIE_P_VALUE and round(p, 4) == TIE_P_VALUE
