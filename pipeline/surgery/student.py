"""The distillation student cut from its teacher: an evenly spaced subset of the teacher's encoder layers (the last
one always; embeddings and head kept), optionally fewer FFN neurons per layer (chosen and least-squares repaired
as `pipeline.surgery.prune` does), and parameter counts."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline.surgery.errors import DistillError
from pipeline.surgery.prune import calibration_batches, prune_encoder

if TYPE_CHECKING:
    from pipeline.core.params import PruneParams

#: (attribute path of the encoder's layer list, config key of the layer count) per architecture family.
_LAYER_LISTS = (("bert.encoder.layer", "num_hidden_layers"), ("distilbert.transformer.layer", "n_layers"),
                ("roberta.encoder.layer", "num_hidden_layers"))


def _find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList, str]:
    """Where the encoder keeps its layers: attribute path, the layer list and the config key that counts them."""
    for path, key in _LAYER_LISTS:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, torch.nn.ModuleList):
            return path, layers, key
    raise DistillError(f"{type(model).__name__}: no encoder layer list at any of {[p for p, _ in _LAYER_LISTS]}")


def layer_list(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, str]:
    """The encoder's list of layers and the config key that counts them."""
    _, layers, key = _find_layers(model)
    return layers, key


def kept_layers(teacher_depth: int, depth: int) -> list[int]:
    """Indices of the teacher layers the student keeps: evenly spaced, the last one always (it feeds the head).

    6 -> 3 keeps 1, 3, 5 (every other layer, as DistilBERT took from BERT); depth >= teacher_depth keeps all."""
    if depth >= teacher_depth:
        return list(range(teacher_depth))
    return [round((i + 1) * teacher_depth / depth) - 1 for i in range(depth)]


def build_student(teacher: torch.nn.Module, depth: int) -> tuple[torch.nn.Module, list[int]]:
    """A copy of `teacher` with only `kept_layers(...)` of its encoder layers (weights copied, config updated)."""
    student = copy.deepcopy(teacher)
    path, layers, key = _find_layers(student)
    keep = kept_layers(len(layers), depth)
    kept = torch.nn.ModuleList([layers[i] for i in keep])
    parent_path, _, name = path.rpartition(".")
    setattr(student.get_submodule(parent_path), name, kept)
    setattr(student.config, key, len(keep))
    for i, layer in enumerate(kept):  # attention modules that index a KV cache by layer number
        attention = getattr(getattr(layer, "attention", None), "self", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = i
    return student, keep


def count_parameters(model: torch.nn.Module, encoder_only: bool = False) -> int:
    if encoder_only:
        layers, _ = layer_list(model)
        return sum(p.numel() for p in layers.parameters())
    return sum(p.numel() for p in model.parameters())


def narrow_ffn(student: torch.nn.Module, reviews: list[np.ndarray], ffn_width: int, pad: int, *,
               calibration: PruneParams, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The student with `ffn_width` FFN neurons per layer, chosen and least-squares repaired as `prune` does
    (`prune_encoder`), on the calibration the prune settings give it (`calibration_samples` training reviews drawn
    with `seed`, in batches of `calibration_batch_size`, `damp`); its config's `intermediate_size` follows, so it
    saves and loads as an ordinary HF model. Heads are not narrowed: a BERT config cannot state fewer heads of the
    same size."""
    from pipeline.data.tokens import draw_rows

    drawn = [reviews[i] for i in draw_rows(len(reviews), calibration.calibration_samples, seed)]
    batches = calibration_batches(drawn, batch_size=calibration.calibration_batch_size, pad_id=pad)
    narrowed, report = prune_encoder(student, batches, None, ffn_width, damp=calibration.damp)
    return narrowed, {"ffn_width": report["ffn_width"], "teacher_ffn_width": report["original_ffn_width"],
                      "ffn_rel_error": report["ffn_rel_error"]}
