"""The distillation student cut from its teacher: which layers it keeps and how (weights, config, reload)."""

from __future__ import annotations

import pytest
import torch

from pipeline.surgery.errors import DistillError
from pipeline.surgery.student import build_student, kept_layers
from tests.factories import tiny_classifier


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


def test_student_copies_the_kept_layers_embeddings_and_head(tmp_path):
    teacher = tiny_classifier(4)
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
