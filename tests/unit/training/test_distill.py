"""The distill stage's training: a whole `distill` + student variants run on the tiny BERT, a disabled or `auto`
student's records, and the student's Lightning module on hidden states."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.core.params import (
    DataParams,
    DistillParams,
    ExportParams,
    ModelParams,
    Params,
    TrainParams,
    resolve_auto,
)
from pipeline.data.batching import NO_LABEL
from pipeline.surgery.errors import DistillError
from pipeline.surgery.student import build_student
from tests.factories import synthetic_reviews, tiny_classifier, write_tokenized


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny 2-layer teacher (trained briefly) distilled into 1 layer with half its FFN neurons, and the
    student's variants."""
    from pipeline.training.distill import distill
    from pipeline.training.finetune import FinetuneOutputs, finetune
    from pipeline.variants.distilled import run_distilled_variants

    root = tmp_path_factory.mktemp("distill")
    tok = write_tokenized(root / "tokenized", {"train": 96, "val": 32, "test": 48})
    from pipeline.data.tokens import tokenize_frame
    from pipeline.modeling import load_tokenizer

    transfer = synthetic_reviews(64, seed=9)[["text"]]
    tokenize_frame(transfer, load_tokenizer(ModelParams(source="tiny")), DataParams(max_length=64)).to_parquet(
        tok / "transfer.parquet")
    teacher_dir = root / "teacher"
    train = TrainParams(epochs=1, batch_size=16, precision="32-true", max_length=None,
                        checkpoint_dir=str(root / "checkpoints"))  # not the checkout's ./checkpoints
    teacher = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=train)
    finetune(tok, FinetuneOutputs(teacher_dir, root / "finetune.json", root / "plots", root / "reports"), teacher,
             resolve_auto(teacher).precision)
    params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=train,
                    distill=DistillParams(depth=1, ffn_width=64, epochs=1, batch_size=16, lr=5e-4),
                    export=ExportParams(parity_samples=8))
    auto = resolve_auto(params)
    result = distill(teacher_dir, tok, root / "student", root / "distill.json", root / "distill-plots", params,
                     auto.precision)
    report = run_distilled_variants(student_dir=root / "student", tokenized=tok, variants_root=root / "variants",
                                    params=params, weight_format=auto.weight_format)
    return {"root": root, "result": result, "report": report, "teacher": teacher_dir}


@pytest.mark.slow  # the opt-in distill stage's whole build (the default profile leaves it off): `make test-all`
def test_distill_writes_a_student_with_its_record(distilled):
    from pipeline.modeling import load_finetuned

    m = distilled["result"].metrics
    assert m["labelled_reviews"] == 96 and m["transfer_reviews"] == 64
    assert m["student_layers"] == 1 and m["teacher_layers"] == 2
    assert m["student_encoder_parameters"] * 2 < m["teacher_encoder_parameters"]  # half the layers, narrower FFN
    assert 0.0 <= m["test_accuracy"] <= 1.0 and 0.0 <= m["teacher_train_accuracy"] <= 1.0
    model, _, meta = load_finetuned(distilled["root"] / "student")
    assert model.config.num_hidden_layers == 1
    assert meta["distillation"]["kept_layers"] == [1] and meta["distillation"]["transfer_reviews"] == 64
    assert meta["distillation"]["ffn_width"] == 64 and meta["distillation"]["teacher_ffn_width"] == 128
    assert model.config.intermediate_size == 64 and model.bert.encoder.layer[0].intermediate.dense.out_features == 64
    teacher_meta = json.loads((distilled["teacher"] / "pipeline.json").read_text())
    assert meta["preprocessing"] == teacher_meta["preprocessing"]  # the student reads reviews as the teacher does
    assert meta["choices"]["train.precision"]["value"] == "32-true"
    assert meta["distillation"]["teacher_reads"] == "window"
    assert (m["teacher_labelling_device"], m["teacher_labelling_autocast"]) == ("cpu", "none")
    assert (distilled["root"] / "distill-plots" / "train.csv").is_file()


@pytest.mark.slow  # the opt-in distill stage's whole build (the default profile leaves it off): `make test-all`
def test_student_variants_pass_the_teachers_checks(distilled):
    from pipeline.runtimes.base import pad_batch
    from pipeline.runtimes.record import read_variant
    from pipeline.runtimes.registry import load_runner

    root, report = distilled["root"], distilled["report"]
    fp32 = read_variant(root / "variants" / "fp32-distilled")
    int8 = read_variant(root / "variants" / "int8-distilled")
    assert fp32.status == int8.status == "ok"
    assert fp32.params["parity_max_abs_diff"] <= ExportParams().parity_tolerance
    assert fp32.params["num_layers"] == 1 and fp32.params["cls_readout"] is True
    assert int8.params["int8_matmuls"] > 0 and int8.params["cls_readout"] is True
    assert report["int8-distilled"]["fused_parity_max_abs_diff"] < 1e-3
    # the variant directory carries the student's own config and record, not the teacher's
    assert json.loads((root / "variants" / "int8-distilled" / "config.json").read_text())["num_hidden_layers"] == 1
    ids, mask = pad_batch([np.array([101, 2307, 3185, 102]), np.array([101, 6659, 102])])
    logits = load_runner(root / "variants" / "int8-distilled")(ids, mask)
    assert logits.shape == (2, 2) and np.isfinite(logits).all()
    # int8-openvino's recipe on the student: its own 1-layer graph, with the readout, close to fp32-distilled
    ov = read_variant(root / "variants" / "int8-distilled-openvino")
    assert ov.status == "ok" and ov.format == "openvino" and ov.params["cls_readout"] is True
    assert ov.params["student_layers"] == 1
    ov_logits = load_runner(root / "variants" / "int8-distilled-openvino")(ids, mask)
    fp32_logits = load_runner(root / "variants" / "fp32-distilled")(ids, mask)
    assert np.abs(ov_logits - fp32_logits).max() < 5e-2


def test_a_disabled_student_leaves_skipped_records(tmp_path):
    from pipeline.runtimes.record import read_variant
    from pipeline.training.distill import write_skipped
    from pipeline.variants.distilled import run_distilled_variants

    reason = "distill.enabled is false"
    result = write_skipped(tmp_path / "student", tmp_path / "distill.json", tmp_path / "plots", reason)
    assert result.status == "skipped"
    report = run_distilled_variants(student_dir=tmp_path / "student", tokenized=tmp_path,
                                    variants_root=tmp_path / "variants", params=Params(),
                                    weight_format=resolve_auto(Params()).weight_format)
    assert set(report) == {"fp32-distilled", "int8-distilled", "int8-distilled-openvino"}
    for name in report:
        info = read_variant(tmp_path / "variants" / name)
        assert info.status == "skipped" and info.reason == "distill.enabled is false"


@pytest.mark.parametrize(("enabled", "skipped"), [("auto", True), (True, False)])
def test_auto_skips_a_student_that_would_train_in_fp32_on_the_cpu_and_says_why(tmp_path, monkeypatch, enabled,
                                                                               skipped, tracking_store):
    """`distill.enabled: auto` where the CPU trains in 32-true: no teacher is read, the record, the metrics and
    the MLflow run say what `auto` resolved to and why; `true` trains the student whatever the precision."""
    import mlflow

    import pipeline.training.distill as distill_module
    from pipeline.core.params import MlflowParams
    from pipeline.core.parent_run import start_tracking
    from pipeline.training.distill import STUDENT_RECORD, DistillResult, run_distill

    trained: list[bool] = []

    def fake_distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params, precision,
                     metric_sink=None, enabled=None, plan=None):
        assert precision.value == "32-true"  # resolved once, by the stage, and handed down
        trained.append(enabled.value)
        for directory in (student_dir, plots_dir):
            directory.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("{}")
        return DistillResult({"precision": "32-true", "teacher_labelling_device": "cpu",
                              "teacher_labelling_autocast": "none"}, tmp_path / "student")

    monkeypatch.setattr(distill_module, "distill", fake_distill)
    tracking = MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-distill",
                            system_metrics=False)
    params = Params(train=TrainParams(precision="32-true", accelerator="cpu",
                                      checkpoint_dir=str(tmp_path / "checkpoints")),  # not the checkout's
                    distill=DistillParams(enabled=enabled), mlflow=tracking)
    from pipeline.runtimes.record import read_variant
    from pipeline.variants.distilled import run_distilled_variants
    from tests.factories import AVX2_ONLY_FLAGS

    monkeypatch.setenv("PIPELINE_CPU_FLAGS", AVX2_ONLY_FLAGS)  # the rehearsal of an AVX2-only CPU's choice
    variants = tmp_path / "variants"
    auto = resolve_auto(params)
    built = ((lambda: run_distilled_variants(student_dir=tmp_path / "student", tokenized=tmp_path,
                                             variants_root=variants, params=params, weight_format=auto.weight_format))
             if skipped else dict)
    result = run_distill(teacher_dir=tmp_path / "no-teacher", tokenized_dir=tmp_path, student_dir=tmp_path / "student",
                         metrics_path=tmp_path / "distill.json", plots_dir=tmp_path / "plots", params=params, auto=auto,
                         run_context=start_tracking(tracking, run_id="unit-distill"), build_variants=built)
    assert (result.status == "skipped") is skipped and trained == ([] if skipped else [True])
    mlflow.set_tracking_uri(tracking.tracking_uri)
    run = mlflow.search_runs(experiment_names=["unit-distill"], output_format="list")[0]
    assert run.data.tags["distill.enabled.resolved"].startswith(f"{not skipped} (asked {enabled}")
    if skipped:
        record = json.loads((tmp_path / "student" / STUDENT_RECORD).read_text())
        assert record["status"] == "skipped" and "32-true" in record["reason"]
        assert record["enabled"] == {"setting": "distill.enabled", "asked": "auto", "value": False,
                                     "reason": record["enabled"]["reason"]}
        assert json.loads((tmp_path / "distill.json").read_text()) == record
        assert run.data.tags["status"] == "skipped"
        assert "longer than a whole default make run" in run.data.tags["reason"]
        assert "PIPELINE_CPU_FLAGS" in record["enabled"]["reason"]  # decided with the rehearsed flags, and says so
        # the student's variants carry the same reason
        for name in ("fp32-distilled", "int8-distilled", "int8-distilled-openvino"):
            info = read_variant(variants / name)
            assert info.status == "skipped" and info.reason == record["reason"], name


def test_hidden_state_loss_matches_each_student_layer_to_its_teacher_layer():
    from pipeline.surgery.distill_loss import hidden_state_loss
    from pipeline.training.classifier import OptimisationRecipe
    from pipeline.training.student_classifier import StudentClassifier

    teacher = tiny_classifier(4)
    student, keep = build_student(teacher, 2)
    ids = torch.randint(1000, 2000, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        t = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        s = student(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(s) == 3 and len(t) == 5
    # the student's first layer is the teacher's layer 1, fed embeddings instead of layer 0's output: not equal
    loss = hidden_state_loss(s, t, keep, mask)
    assert loss > 0
    # a student that keeps every layer reproduces the teacher exactly
    whole, all_layers = build_student(teacher, 4)
    with torch.no_grad():
        w = whole(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert hidden_state_loss(w, t, all_layers, mask) < 1e-10
    # padded positions do not count
    noisy = tuple(h.clone() for h in s)
    for h in noisy[1:]:
        h[1, 5:] += 100.0
    assert torch.isclose(hidden_state_loss(noisy, t, keep, mask), loss)

    module = StudentClassifier(student.train(), DistillParams(hidden_weight=0.5), OptimisationRecipe(lr=1e-4),
                               teacher=teacher, kept=keep)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, NO_LABEL]),
             "teacher_logits": torch.zeros(2, 2)}
    module.log = lambda *a, **k: None  # outside a Trainer
    step = module.training_step(batch, 0)
    step.backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is frozen
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    with pytest.raises(DistillError, match="needs the teacher"):
        StudentClassifier(student, DistillParams(hidden_weight=0.5), OptimisationRecipe(lr=1e-4))


class _UnusedContext:
    """A run context that fails any use: a process of rank > 0 must not look the parent run up."""

    def __getattr__(self, name):
        if name.startswith("__"):  # Python's and pytest's own look-ups
            raise AttributeError(name)
        raise AssertionError(f"a process of rank > 0 used the MLflow context ({name})")


@pytest.mark.parametrize("context", [None, _UnusedContext()], ids=["no context", "a context"])
def test_a_ddp_process_of_rank_above_zero_only_trains(tmp_path, monkeypatch, context):
    """Lightning runs the stage again in each further DDP process (LOCAL_RANK set): that process trains its share
    and opens no MLflow run, builds no variants, and leaves the records to rank 0."""
    import pipeline.training.distill as distill_module
    from pipeline.training.distill import DistillResult, run_distill

    trained: list[object] = []

    def fake_distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params, precision,
                     metric_sink=None, enabled=None, plan=None):
        trained.append((metric_sink, plan))
        return DistillResult({}, student_dir, "worker")

    def no_variants():
        raise AssertionError("a process of rank > 0 built the student's variants")

    monkeypatch.setattr(distill_module, "distill", fake_distill)
    monkeypatch.setenv("LOCAL_RANK", "1")
    params = Params(train=TrainParams(checkpoint_dir=str(tmp_path / "checkpoints")),
                    distill=DistillParams(enabled=True))
    result = run_distill(teacher_dir=tmp_path / "teacher", tokenized_dir=tmp_path, student_dir=tmp_path / "student",
                         metrics_path=tmp_path / "distill.json", plots_dir=tmp_path / "plots", params=params,
                         auto=resolve_auto(params), run_context=context, build_variants=no_variants)
    assert result.status == "worker" and trained == [(None, None)]  # no MLflow sink, no plan of rank 0's run
    assert not (tmp_path / "distill.json").exists() and not (tmp_path / "student").exists()


def test_distill_on_a_rank_above_zero_returns_after_training_and_writes_nothing(tmp_path, monkeypatch, tokenized_dir,
                                                                                tiny_model_dir):
    """After the fit, a process of rank > 0 neither scores nor saves: the best epoch is rank 0's to load (it alone
    does), and the student, its metrics, curves and the checkpoints are rank 0's to write and clear."""
    import math
    from types import SimpleNamespace

    import pipeline.training.loop as loop
    from pipeline.core.machine import training_attention
    from pipeline.training.curves import CurveRecorder
    from pipeline.training.distill import distill
    from pipeline.training.loop import Fitted

    def fake_fit(module, params, **kwargs):
        return Fitted(SimpleNamespace(is_global_zero=False, global_step=3), CurveRecorder(), "", math.nan,
                      training_attention(params.precision, params.accelerator))

    def no_scoring(*args, **kwargs):
        raise AssertionError("a process of rank > 0 scored the test split")

    monkeypatch.setattr(loop, "fit", fake_fit)
    monkeypatch.setattr(loop, "predict_split", no_scoring)
    monkeypatch.setenv("LOCAL_RANK", "1")
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "distill").mkdir(parents=True)
    (checkpoints / "distill" / "fingerprint.json").write_text("{}")  # rank 0's: left alone
    params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"),
                    train=TrainParams(precision="32-true", accelerator="cpu", checkpoint_dir=str(checkpoints)),
                    distill=DistillParams(enabled=True, depth=1, epochs=1, batch_size=16))
    result = distill(tiny_model_dir, tokenized_dir, tmp_path / "student", tmp_path / "distill.json",
                     tmp_path / "plots", params, resolve_auto(params).precision)
    assert result.status == "worker" and result.metrics == {}
    assert not any(p.exists() for p in (tmp_path / "student", tmp_path / "distill.json", tmp_path / "plots"))
    assert (checkpoints / "distill" / "fingerprint.json").read_text() == "{}"


def test_the_export_settings_do_not_discard_distill_checkpoints(tmp_path):
    """The student's exports are built after training: changing `export` (the ONNX opset) keeps the checkpoint, a
    change of the student's own settings does not."""
    import dataclasses

    from pipeline.training.distill import distill_plan

    teacher, tokenized = tmp_path / "teacher", tmp_path / "tokenized"
    for d in (teacher, tokenized):
        d.mkdir()
        (d / "file").write_text(d.name)
    params = Params(train=TrainParams(checkpoint_dir=str(tmp_path / "checkpoints")), export=ExportParams(opset=18))
    precision = resolve_auto(params).precision
    distill_plan(teacher, tokenized, params, precision)  # writes the fingerprint
    ckpt = tmp_path / "checkpoints" / "distill" / "periodic" / "step=10.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"global_step": 10}, ckpt)
    opset = dataclasses.replace(params, export=ExportParams(opset=19))
    assert distill_plan(teacher, tokenized, opset, precision).resumed
    deeper = dataclasses.replace(opset, distill=DistillParams(depth=3))
    plan = distill_plan(teacher, tokenized, deeper, precision)
    assert not plan.resumed and "distill.depth" in plan.reason


def test_an_unknown_key_in_the_teachers_record_names_the_record_not_params_yaml(tmp_path):
    from pipeline.training.distill import _teacher_data

    meta = {"params": {"data": {"max_length": 64, "stemming": True}}}
    with pytest.raises(DistillError) as error:
        _teacher_data(meta, Params(), tmp_path / "teacher")
    message = str(error.value)
    assert f"the teacher's record {tmp_path / 'teacher' / 'pipeline.json'} (not params.yaml)" in message
    assert "params.data.stemming: unknown key" in message
    assert _teacher_data({"params": {"data": {"max_length": 32}}}, Params(), tmp_path).max_length == 32
