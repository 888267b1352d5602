"""Inference graphs that compute only what the classifier reads.

A [CLS]-pooling classifier reads one position of the last encoder layer. Every other position of that
layer still feeds nothing: its query projection, attention output, out-projection, LayerNorms and the
whole feed-forward block are dead work (about 5/6 of the last layer, 1/7 of MiniLM's matrix products at
128 tokens). `cls_readout` returns the same model with its last layer computing the [CLS] position only;
keys and values still come from every position, so the logits are the same up to float rounding. The
exports that feed the INT8 builds use it; parity against the unchanged model is checked where it is used."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch


class ReadoutError(ValueError):
    """The model's head reads more than the [CLS] position, or its layers are not BERT-style."""


class ClsOnlyLayer(torch.nn.Module):
    """A BERT encoder layer that returns the [CLS] position only, shape (batch, 1, hidden).

    It takes the modules of a `BertLayer` as they are (any head count, pruned or not): query, key, value,
    the attention output block (dense, dropout, residual LayerNorm) and the feed-forward block.
    """

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self_attention = layer.attention.self
        self.query, self.key, self.value = self_attention.query, self_attention.key, self_attention.value
        self.head_dim = int(self_attention.attention_head_size)
        self.heads = int(self.query.out_features) // self.head_dim
        self.attention_output = layer.attention.output
        self.intermediate = layer.intermediate
        self.output = layer.output

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        cls = hidden_states[:, :1]
        q = self.query(cls).view(batch, 1, self.heads, self.head_dim).transpose(1, 2)
        k = self.key(hidden_states).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(hidden_states).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.head_dim))
        if attention_mask is not None:
            row = attention_mask[:, :, :1, :]  # the [CLS] query's row of a (batch, 1, 1|length, length) mask
            if row.dtype == torch.bool:
                scores = scores.masked_fill(~row, torch.finfo(scores.dtype).min)
            else:
                scores = scores + row
        context = torch.matmul(torch.softmax(scores, dim=-1), v)
        context = context.transpose(1, 2).reshape(batch, 1, self.heads * self.head_dim)
        attended = self.attention_output(context, cls)
        return self.output(self.intermediate(attended), attended)


def unsupported(model: Any) -> str | None:
    """Why `cls_readout` cannot rewrite this model, or None when it can."""
    from transformers import BertForSequenceClassification

    if not isinstance(model, BertForSequenceClassification):
        return (f"{type(model).__name__} reads more than the [CLS] position or is not BERT-style; "
                "only BertForSequenceClassification ([CLS] pooling) is rewritten")
    if getattr(model.config, "is_decoder", False):
        return "decoder BERT layers attend causally; the [CLS] readout assumes an encoder"
    return None


def cls_readout(model: Any) -> Any:
    """A copy of a [CLS]-pooling BERT classifier whose last layer computes the [CLS] position only.

    Raises `ReadoutError` for heads that read every position (mean pooling) or non-BERT layer layouts, so a
    caller can export the full graph instead and say why.
    """
    reason = unsupported(model)
    if reason is not None:
        raise ReadoutError(reason)
    out = copy.deepcopy(model).eval()
    layers = out.bert.encoder.layer
    layers[len(layers) - 1] = ClsOnlyLayer(layers[len(layers) - 1])
    return out
