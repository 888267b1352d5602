"""The student's Lightning module: `SentimentClassifier` trained on the teacher's logits (`distillation_loss`) and,
optionally, on the teacher's hidden states."""

from __future__ import annotations

import torch

from pipeline.core.params import DistillParams
from pipeline.surgery.distill_loss import distillation_loss, hidden_state_loss
from pipeline.surgery.errors import DistillError
from pipeline.training.classifier import OptimisationRecipe, SentimentClassifier


class StudentClassifier(SentimentClassifier):
    """`SentimentClassifier` trained on the teacher's logits in each batch (`teacher_logits`) and, with
    `distill.hidden_weight` > 0, on the teacher's hidden states (the teacher runs alongside, frozen)."""

    def __init__(self, model: torch.nn.Module, params: DistillParams, recipe: OptimisationRecipe,
                 teacher: torch.nn.Module | None = None, kept: list[int] | None = None) -> None:
        super().__init__(model, recipe)
        self.kl_weight = 1.0 - params.hard_label_weight
        self.temperature = params.temperature
        self.hidden_weight = params.hidden_weight
        if self.hidden_weight > 0 and (teacher is None or kept is None):
            raise DistillError("distill.hidden_weight > 0 needs the teacher and the kept layer indices")
        # a plain attribute, not a submodule: the teacher is neither trained nor saved with the student
        object.__setattr__(self, "_teacher", None if teacher is None else teacher.eval().requires_grad_(False))
        self.kept = kept or []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.hidden_weight > 0:
            out = self._fn()(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            logits = out.logits
            teacher = self._teacher.to(ids.device)
            with torch.no_grad():
                reference = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            hidden = hidden_state_loss(out.hidden_states, reference, self.kept, mask)
            self.log("hidden_loss", hidden, batch_size=len(ids))
        else:
            logits, hidden = self(ids, mask), None
        loss = distillation_loss(logits, batch["teacher_logits"], batch["labels"], self.kl_weight, self.temperature)
        if hidden is not None:
            loss = loss + self.hidden_weight * hidden
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss
