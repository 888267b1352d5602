"""The distillation losses: soft targets at a temperature and unknown labels, also in QAT."""

from __future__ import annotations

import torch

from pipeline.data.batching import NO_LABEL
from pipeline.surgery.distill_loss import distillation_loss


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


def test_distillation_loss_against_cross_entropy_and_a_matching_teacher():
    """The loss QAT and the student share: labels only at KL weight 0, nothing to learn from a teacher that
    already agrees, something from one that disagrees, and the label term scaled by its weight."""
    import torch

    from pipeline.surgery.distill_loss import distillation_loss

    logits = torch.tensor([[2.0, -1.0], [0.5, 0.3]])
    labels = torch.tensor([1, 0])
    ce = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.isclose(distillation_loss(logits, logits + 5.0, labels, 0.0), ce)  # labels only
    assert distillation_loss(logits, logits, labels, 1.0).abs() < 1e-6  # already matches FP32: nothing to learn
    assert distillation_loss(logits, logits.flip(-1), labels, 1.0) > 0.1
    half = distillation_loss(logits, logits, labels, 0.5)
    assert torch.isclose(half, 0.5 * ce, atol=1e-6)


def test_a_batch_of_transfer_reviews_only_backpropagates_zero_with_labels_alone():
    """`hard_label_weight: 1.0` (KL weight 0) and a batch with no known label: the loss is a zero that stays in the
    autograd graph, so the training step's backward() runs and moves nothing."""
    logits = torch.randn(3, 2, requires_grad=True)
    loss = distillation_loss(logits * 2.0, torch.randn(3, 2), torch.full((3,), NO_LABEL), 0.0, 2.0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros(3, 2))
