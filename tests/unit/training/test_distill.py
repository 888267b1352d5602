"""The distilled student: which layers it keeps and how (weights, config, reload), the distillation loss, the
teacher-only labelling of the transfer reviews, and a whole `distill` + student variants run on the tiny BERT."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.core.params import DataParams, DistillParams, ExportParams, ModelParams, Params, TrainParams
from pipeline.data.batching import NO_LABEL, Collator, TokenizedDataset
from pipeline.training.distill import (
    DistillError,
    Labelling,
    build_student,
    distillation_loss,
    kept_layers,
    labelling_setup,
    read_transfer_ids,
    transfer_set,
)
from tests.factories import synthetic_reviews, write_tokenized


@pytest.mark.parametrize(("teacher", "depth", "kept"), [
    (6, 3, [1, 3, 5]),  # every other layer, the last one kept
    (12, 6, [1, 3, 5, 7, 9, 11]),
    (6, 2, [2, 5]),
    (6, 1, [5]),
    (4, 4, [0, 1, 2, 3]),
    (4, 9, [0, 1, 2, 3]),
])
def test_kept_layers_are_evenly_spaced_and_end_with_the_last(teacher, depth, kept):
    assert kept_layers(teacher, depth) == kept


def _tiny(layers: int = 4):
    from transformers import AutoModelForSequenceClassification

    from pipeline.modeling import tiny_bert_config

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_bert_config(layers=layers)).eval()


def test_student_copies_the_kept_layers_embeddings_and_head(tmp_path):
    teacher = _tiny(4)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student, keep = build_student(teacher, 2)
    assert keep == [1, 3]
    assert student.config.num_hidden_layers == 2 and len(student.bert.encoder.layer) == 2
    assert teacher.config.num_hidden_layers == 4  # the teacher is untouched
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    t, s = teacher.state_dict(), student.state_dict()
    for i, j in enumerate(keep):
        for name in ("attention.self.query.weight", "intermediate.dense.weight", "output.LayerNorm.bias"):
            assert torch.equal(s[f"bert.encoder.layer.{i}.{name}"], t[f"bert.encoder.layer.{j}.{name}"])
    for name in ("bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight", "classifier.weight"):
        assert torch.equal(s[name], t[name])
    assert sum(p.numel() for p in student.bert.encoder.parameters()) == pytest.approx(
        sum(p.numel() for p in teacher.bert.encoder.parameters()) / 2)
    s[next(iter(s))].add_(1.0)  # the student's tensors are its own, not views of the teacher's
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())

    ids = torch.randint(1000, 2000, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    student.save_pretrained(tmp_path)  # an ordinary HF model: the config says 2 layers
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids, attention_mask=mask).logits,
                              student.eval()(input_ids=ids, attention_mask=mask).logits, atol=1e-6)


def test_student_of_an_unknown_architecture_is_refused():
    with pytest.raises(DistillError, match="no encoder layer list"):
        build_student(torch.nn.Linear(2, 2), 1)


def test_distillation_loss_terms_temperature_and_unknown_labels():
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.3], [-1.0, 1.5]])
    teacher = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.2, 0.1]])
    labels = torch.tensor([0, 1, NO_LABEL])
    ce = torch.nn.functional.cross_entropy(logits[:2], labels[:2])  # the unlabelled row has no CE term
    assert torch.isclose(distillation_loss(logits, teacher, labels, 0.0), ce)
    for t in (1.0, 2.0, 4.0):
        p_t = torch.softmax(teacher / t, -1)
        kl = (p_t * (p_t.log() - torch.log_softmax(logits / t, -1))).sum(-1).mean()
        assert torch.isclose(distillation_loss(logits, teacher, labels, 1.0, t), t * t * kl, atol=1e-6)
        mixed = distillation_loss(logits, teacher, labels, 0.7, t)
        assert torch.isclose(mixed, 0.7 * t * t * kl + 0.3 * ce, atol=1e-6)
    assert distillation_loss(logits, logits, labels, 1.0, 2.0).abs() < 1e-6  # imitating perfectly: nothing left
    # a batch of teacher-labelled reviews only: the KL term alone, whatever weight the labels have
    unknown = torch.full((3,), NO_LABEL)
    assert torch.isclose(distillation_loss(logits, teacher, unknown, 0.9, 2.0),
                         0.9 * distillation_loss(logits, teacher, unknown, 1.0, 2.0))


def test_unknown_labels_send_no_gradient_through_the_label_term():
    logits = torch.zeros(4, 2, requires_grad=True)
    labels = torch.tensor([1, NO_LABEL, 0, NO_LABEL])
    distillation_loss(logits, torch.zeros(4, 2), labels, 0.0).backward()
    assert logits.grad[[1, 3]].abs().sum() == 0 and logits.grad[[0, 2]].abs().sum() > 0


def test_transfer_split_is_unlabelled_disjoint_and_drawn_without_labels():
    from pipeline.data.imdb import TRANSFER, make_splits

    frame = synthetic_reviews(400)
    params = DataParams(train_count=300, val_count=50, train_subsample=100, seed=0, transfer_reviews=150)
    splits, report = make_splits(frame, params)
    transfer = splits[TRANSFER]
    assert list(transfer.columns) == ["text"] and len(transfer) == 150 and report.sizes[TRANSFER] == 150
    labelled = set().union(*(set(splits[s]["text"]) for s in ("train", "val", "test")))
    assert not set(transfer["text"]) & labelled
    full, _ = make_splits(frame, DataParams(train_count=300, val_count=50, seed=0))
    assert set(transfer["text"]) <= set(full["train"]["text"])  # from the train split's unused part only
    # asking for more than is left takes what is left; none asked, none written
    more, _ = make_splits(frame, DataParams(train_count=300, val_count=50, train_subsample=100, seed=0,
                                            transfer_reviews=10_000))
    assert len(more[TRANSFER]) == 200
    none, _ = make_splits(frame, DataParams(train_count=300, val_count=50, train_subsample=100, seed=0,
                                            transfer_reviews=0))
    assert TRANSFER not in none


def test_transfer_draw_never_reads_a_label(monkeypatch):
    """The draw is handed the unused train reviews without their label column; here a frame whose `label`
    access raises would fail it."""
    import pipeline.data.imdb as imdb

    seen: list[list[str]] = []
    original = imdb._transfer_reviews

    def spy(unused: pd.DataFrame, params: DataParams):
        seen.append(list(unused.columns))
        return original(unused, params)

    monkeypatch.setattr(imdb, "_transfer_reviews", spy)
    imdb.make_splits(synthetic_reviews(400), DataParams(train_count=300, val_count=50, train_subsample=100,
                                                        seed=0, transfer_reviews=50))
    assert seen == [["text"]]


def test_a_labelled_transfer_split_is_refused(tmp_path):
    write_tokenized(tmp_path, {"transfer": 8})  # written with a label column: not what prepare writes
    with pytest.raises(DistillError, match="must be unlabelled"):
        read_transfer_ids(tmp_path)
    assert read_transfer_ids(tmp_path / "nothing-here") == []


def test_soft_targets_travel_with_their_reviews():
    ids = [np.array([101, 5, 102]), np.array([101, 5, 6, 7, 102])]
    soft = np.array([[0.1, 0.9], [2.0, -2.0]], dtype=np.float32)
    ds = TokenizedDataset(ids, [1, NO_LABEL], soft)
    batch = Collator(pad_id=0, multiple_of=4)([ds[1], ds[0]])
    assert batch["labels"].tolist() == [NO_LABEL, 1]
    assert torch.equal(batch["teacher_logits"], torch.tensor(soft[[1, 0]]))
    assert "teacher_logits" not in Collator()([(ids[0], 1)])
    with pytest.raises(ValueError, match="soft targets"):
        TokenizedDataset(ids, [1, 0], soft[:1])


class _RecordingTeacher(torch.nn.Module):
    """A stand-in teacher: remembers the length of every review it reads (its real tokens) and says 'positive'
    with a confidence that grows with that length."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.read: list[int] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        lengths = attention_mask.sum(-1)
        self.read.extend(lengths.tolist())
        logits = torch.stack([-lengths.float(), lengths.float()], -1) * self.scale
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("reads", ["window", "review"])
def test_teacher_reads_the_window_or_the_whole_review_while_the_student_gets_its_window(reads):
    reviews = [np.arange(1, n + 1) for n in (12, 7, 20)]
    labelled = TokenizedDataset(reviews[:2], np.array([1, 0]))

    def window(ids: np.ndarray) -> np.ndarray:
        return ids[:8]

    teacher = _RecordingTeacher()
    got = transfer_set(teacher, labelled, [reviews[2]], window, reads, batch_size=2, pad_id=0,
                       labelling=Labelling("cpu", None))
    assert [len(x) for x in got.input_ids] == [8, 7, 8]  # the student always trains on its window
    assert got.labels.tolist() == [1, 0, NO_LABEL] and (got.labelled, got.unlabelled) == (2, 1)
    expected = [12, 7, 20] if reads == "review" else [8, 7, 8]
    assert sorted(teacher.read) == sorted(expected)
    assert got.teacher_logits[:, 1].tolist() == expected  # each review's logits are those of its own reading
    with pytest.raises(DistillError, match="teacher_reads"):
        transfer_set(teacher, labelled, [], window, "summary", 2, 0, Labelling("cpu", None))
    with pytest.raises(ValueError, match="teacher_reads"):
        DistillParams(teacher_reads="summary")


@pytest.mark.parametrize(("precision", "accelerator", "cuda", "expected"), [
    ("32-true", "cpu", False, Labelling("cpu", None)),
    ("bf16-mixed", "cpu", False, Labelling("cpu", "bf16")),  # resolved so only where the CPU has native bf16
    ("bf16-mixed", "auto", True, Labelling("cuda", "bf16")),
    ("16-mixed", "gpu", True, Labelling("cuda", "fp16")),
    ("16-mixed", "cpu", True, Labelling("cpu", None)),  # training on the CPU of a GPU machine: label there too
    ("32-true", "cuda", True, Labelling("cuda", None)),
])
def test_the_teacher_labels_where_and_how_the_student_trains(precision, accelerator, cuda, expected):
    assert labelling_setup(TrainParams(accelerator=accelerator), precision, cuda=cuda) == expected


def test_the_teacher_is_back_on_the_cpu_after_labelling_even_when_labelling_fails():
    from pipeline.training.distill import teacher_logits

    class Failing(_RecordingTeacher):
        def __init__(self) -> None:
            super().__init__()
            self.moves: list[str] = []

        def to(self, device: str) -> Failing:  # records the moves instead of making them (no GPU here)
            self.moves.append(str(device))
            return self

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
            raise RuntimeError("out of memory")

    teacher = Failing()
    with pytest.raises(RuntimeError, match="out of memory"):
        teacher_logits(teacher, [np.arange(1, 5)], 2, 0, Labelling("cuda", "bf16"))
    assert teacher.moves == ["cuda", "cpu"]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny 2-layer teacher (trained briefly) distilled into 1 layer with half its FFN neurons, and the
    student's variants."""
    from pipeline.training.distill import distill
    from pipeline.training.finetune import finetune
    from pipeline.variants.distilled import run_distilled_variants

    root = tmp_path_factory.mktemp("distill")
    tok = write_tokenized(root / "tokenized", {"train": 96, "val": 32, "test": 48})
    from pipeline.data.tokens import tokenize_frame
    from pipeline.modeling import load_tokenizer

    transfer = synthetic_reviews(64, seed=9)[["text"]]
    tokenize_frame(transfer, load_tokenizer(ModelParams(source="tiny")), DataParams(max_length=64)).to_parquet(
        tok / "transfer.parquet")
    teacher_dir = root / "teacher"
    train = TrainParams(epochs=1, batch_size=16, precision="32-true", max_length=None)
    finetune(tok, teacher_dir, root / "finetune.json", root / "plots", root / "reports", DataParams(max_length=64),
             ModelParams(source="tiny"), train)
    params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=train,
                    distill=DistillParams(depth=1, ffn_width=64, epochs=1, batch_size=16, lr=5e-4),
                    export=ExportParams(parity_samples=8))
    result = distill(teacher_dir, tok, root / "student", root / "distill.json", root / "distill-plots", params)
    report = run_distilled_variants(root / "student", tok, root / "variants", params)
    return {"root": root, "result": result, "report": report, "teacher": teacher_dir}


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


def test_student_variants_pass_the_teachers_checks(distilled):
    from pipeline.variants.record import read_variant
    from pipeline.variants.runners import load_runner, pad_batch

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


def test_a_disabled_student_leaves_skipped_records(tmp_path):
    from pipeline.training.distill import write_skipped
    from pipeline.variants.distilled import run_distilled_variants
    from pipeline.variants.record import read_variant

    reason = "distill.enabled is false"
    result = write_skipped(tmp_path / "student", tmp_path / "distill.json", tmp_path / "plots", reason)
    assert result.status == "skipped"
    report = run_distilled_variants(tmp_path / "student", tmp_path, tmp_path / "variants", Params())
    assert set(report) == {"fp32-distilled", "int8-distilled"}
    for name in report:
        info = read_variant(tmp_path / "variants" / name)
        assert info.status == "skipped" and info.reason == "distill.enabled is false"


@pytest.mark.parametrize(("enabled", "skipped"), [("auto", True), (True, False)])
def test_auto_skips_a_student_that_would_train_in_fp32_on_the_cpu_and_says_why(tmp_path, monkeypatch, enabled,
                                                                               skipped):
    """`distill.enabled: auto` where the CPU trains in 32-true: no teacher is read, the record, the metrics and
    the MLflow run say what `auto` resolved to and why; `true` trains the student whatever the precision."""
    import mlflow

    import pipeline.training.distill as distill_module
    from pipeline.core.params import MlflowParams
    from pipeline.training.distill import STUDENT_RECORD, DistillResult, run_distill

    trained: list[bool] = []

    def fake_distill(teacher_dir, tokenized_dir, student_dir, metrics_path, plots_dir, params, metric_sink=None,
                     enabled=None, precision=None, plan=None):
        assert precision.value == "32-true"  # resolved once, by run_distill, and handed down
        trained.append(enabled.value)
        for directory in (student_dir, plots_dir):
            directory.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("{}")
        return DistillResult({"precision": "32-true", "teacher_labelling_device": "cpu",
                              "teacher_labelling_autocast": "none"}, tmp_path / "student")

    monkeypatch.setattr(distill_module, "distill", fake_distill)
    tracking = MlflowParams(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="unit-distill",
                            system_metrics=False)
    params = Params(train=TrainParams(precision="32-true", accelerator="cpu"),
                    distill=DistillParams(enabled=enabled), mlflow=tracking)
    from pipeline.variants.distilled import run_distilled_variants
    from pipeline.variants.record import read_variant
    from tests.factories import AVX2_ONLY_FLAGS

    monkeypatch.setenv("PIPELINE_CPU_FLAGS", AVX2_ONLY_FLAGS)  # the rehearsal of an AVX2-only CPU's choice
    variants = tmp_path / "variants"
    built = (lambda: run_distilled_variants(tmp_path / "student", tmp_path, variants, params)) if skipped else dict
    result = run_distill(tmp_path / "no-teacher", tmp_path, tmp_path / "student", tmp_path / "distill.json",
                         tmp_path / "plots", params, built)
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
        for name in ("fp32-distilled", "int8-distilled"):  # the student's variants carry the same reason
            info = read_variant(variants / name)
            assert info.status == "skipped" and info.reason == record["reason"], name


def test_hidden_state_loss_matches_each_student_layer_to_its_teacher_layer():
    from pipeline.training.distill import StudentClassifier, hidden_state_loss

    teacher = _tiny(4)
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

    module = StudentClassifier(student.train(), DistillParams(hidden_weight=0.5), 0.0, 0.0, teacher=teacher, kept=keep)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, NO_LABEL]),
             "teacher_logits": torch.zeros(2, 2)}
    module.log = lambda *a, **k: None  # outside a Trainer
    step = module.training_step(batch, 0)
    step.backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is frozen
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    with pytest.raises(DistillError, match="needs the teacher"):
        StudentClassifier(student, DistillParams(hidden_weight=0.5), 0.0, 0.0)
