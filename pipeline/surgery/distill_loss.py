"""The distillation losses: the teacher's softened predictions (KL at a temperature) with cross-entropy on the
known labels, and TinyBERT-style matching of hidden states to the teacher layers they were copied from."""

from __future__ import annotations

import torch

from pipeline.data.batching import NO_LABEL


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      kl_weight: float, temperature: float = 1.0) -> torch.Tensor:
    """`kl_weight` x T^2 x KL(teacher_T || student_T) + (1 - kl_weight) x cross-entropy on the known labels.

    Softening both distributions by `temperature` T shows the student how sure the teacher is, and T^2 keeps the
    KL gradients on the scale of the cross-entropy's (Hinton et al., 2015). Labels equal to `NO_LABEL` (the
    teacher-labelled transfer reviews) contribute to the KL term only; a batch without any known label has no
    cross-entropy term."""
    logits = logits.float()
    known = labels != NO_LABEL
    # without a known label the term is a zero that stays in the autograd graph (zero gradients): a loss with no
    # grad_fn (`new_zeros`) would make backward() raise when the KL term is off too (`kl_weight` 0)
    ce = (torch.nn.functional.cross_entropy(logits[known], labels[known]) if bool(known.any())
          else logits.sum() * 0.0)
    if kl_weight == 0.0:
        return ce
    student = torch.log_softmax(logits / temperature, -1)
    teacher = torch.log_softmax(teacher_logits.float() / temperature, -1)
    kl = torch.nn.functional.kl_div(student, teacher, reduction="batchmean", log_target=True)
    return kl_weight * temperature**2 * kl + (1.0 - kl_weight) * ce


def hidden_state_loss(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...],
                      kept: list[int], mask: torch.Tensor) -> torch.Tensor:
    """Mean squared distance between each student layer's output and the output of the teacher layer it was
    copied from (`kept`), over the real (unpadded) tokens, averaged over layers.

    `*_hidden` are HF `hidden_states` (embeddings first, then one entry per layer), so student layer i is entry
    i + 1 and its teacher layer entry kept[i] + 1. TinyBERT-style layer matching: the student keeps imitating
    what its layers computed in the teacher, not only the teacher's final prediction."""
    weights = mask.unsqueeze(-1).float()
    tokens = weights.sum().clamp(min=1.0) * student_hidden[-1].shape[-1]
    per_layer = [(((s.float() - teacher_hidden[k + 1].float()) ** 2) * weights).sum() / tokens
                 for s, k in zip(student_hidden[1:], kept, strict=True)]
    return torch.stack(per_layer).mean()
