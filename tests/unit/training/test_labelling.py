"""The teacher labels the student's reviews: the transfer split read without labels, soft targets with their
reviews, the training window, where and in which precision the teacher runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.params import DistillParams, TrainParams
from pipeline.data.batching import NO_LABEL, Collator, TokenizedDataset
from pipeline.surgery.errors import DistillError
from pipeline.training.labelling import Labelling, labelling_setup, read_transfer_ids, transfer_set
from tests.factories import write_tokenized


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


@pytest.mark.parametrize("reads", ["window", "review"])
def test_teacher_reads_the_window_or_the_whole_review_while_the_student_gets_its_window(reads):
    reviews = [np.arange(1, n + 1) for n in (12, 7, 20)]
    labelled = TokenizedDataset(reviews[:2], np.array([1, 0]))

    def window(ids: np.ndarray) -> np.ndarray:
        return ids[:8]

    teacher = _RecordingTeacher()
    got = transfer_set(teacher, labelled, [reviews[2]], window=window, teacher_reads=reads, batch_size=2, pad_id=0,
                       labelling=Labelling("cpu", None))
    assert [len(x) for x in got.input_ids] == [8, 7, 8]  # the student always trains on its window
    assert got.labels.tolist() == [1, 0, NO_LABEL] and (got.labelled, got.unlabelled) == (2, 1)
    expected = [12, 7, 20] if reads == "review" else [8, 7, 8]
    assert sorted(teacher.read) == sorted(expected)
    assert got.teacher_logits[:, 1].tolist() == expected  # each review's logits are those of its own reading
    with pytest.raises(DistillError, match="teacher_reads"):
        transfer_set(teacher, labelled, [], window=window, teacher_reads="summary", batch_size=2, pad_id=0,
                     labelling=Labelling("cpu", None))
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
    from pipeline.training.labelling import teacher_logits

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
