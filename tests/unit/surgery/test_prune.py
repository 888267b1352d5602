"""Structured pruning: OBS selection, least-squares repair and the pruned tiny BERT."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.surgery.errors import PruneError
from pipeline.surgery.least_squares import GramAccumulator, obs_select, relative_error
from pipeline.surgery.prune import encoder_layers, prune_encoder


def _stats(x: torch.Tensor, y: torch.Tensor) -> GramAccumulator:
    acc = GramAccumulator(x.shape[1], y.shape[1])
    acc.add(x, y, torch.ones(len(x)))
    return acc


def test_obs_keeps_the_columns_the_target_depends_on():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 12, generator=g)
    a = torch.randn(3, 5, generator=g)
    y = x[:, [1, 4, 9]] @ a + 0.5
    acc = _stats(x, y)
    kept, w = obs_select(acc.gram, acc.cross, [[i] for i in range(12)], 3, damp=1e-8)
    assert kept == [1, 4, 9]
    assert torch.allclose(w[:-1].float(), a, atol=1e-3)  # the repaired weights are the true ones
    assert torch.allclose(w[-1].float(), torch.full((5,), 0.5), atol=1e-3)  # and the intercept


def test_obs_removes_whole_groups_by_what_their_loss_costs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, 6, generator=g)
    # group (2, 3) carries little of the target, group (4, 5) none: those two go first, in that order
    y = x[:, :2] @ torch.randn(2, 3, generator=g) + 0.05 * x[:, 2:4] @ torch.randn(2, 3, generator=g)
    acc = _stats(x, y)
    target_sq = float((y.double() ** 2).sum())
    kept, w = obs_select(acc.gram, acc.cross, [[0, 1], [2, 3], [4, 5]], 2, damp=1e-8)
    assert kept == [0, 1]
    assert relative_error(acc.gram, acc.cross, target_sq, torch.tensor([0, 1, 2, 3, 6]), w) < 1e-6
    kept, w = obs_select(acc.gram, acc.cross, [[0, 1], [2, 3], [4, 5]], 1, damp=1e-8)
    assert kept == [0]
    assert 1e-4 < relative_error(acc.gram, acc.cross, target_sq, torch.tensor([0, 1, 6]), w) < 0.05


def test_obs_repair_lets_a_correlated_survivor_take_over():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3000, 2, generator=g)
    twin = base + 0.01 * torch.randn(3000, 2, generator=g)  # columns 2-3 nearly copy 0-1
    x = torch.cat([base, twin, torch.randn(3000, 2, generator=g)], 1)
    y = base @ torch.randn(2, 3, generator=g) + x[:, 4:] @ torch.randn(2, 3, generator=g)
    acc = _stats(x, y)
    kept, w = obs_select(acc.gram, acc.cross, [[0, 1], [2, 3], [4, 5]], 2, damp=1e-8)
    assert kept in ([0, 2], [1, 2])  # one of the twins goes, the independent group stays
    cols = torch.tensor([c for k in kept for c in ([0, 1], [2, 3], [4, 5])[k]] + [6])
    assert relative_error(acc.gram, acc.cross, float((y.double() ** 2).sum()), cols, w) < 1e-3


def test_obs_rejects_an_impossible_keep():
    acc = _stats(torch.randn(10, 3), torch.randn(10, 1))
    with pytest.raises(PruneError, match="cannot keep 4 of 3"):
        obs_select(acc.gram, acc.cross, [[0], [1], [2]], 4)


def _batches(n: int = 4, length: int = 20, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1000, 2000, (8, length), generator=g)
        mask = torch.ones_like(ids)
        mask[:4, length // 2 :] = 0  # half the batch padded: padding must not drive the fit
        out.append((ids * mask, mask))
    return out


def _tiny(layers: int = 2, heads: int = 4, hidden: int = 64) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=2048, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, num_labels=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).eval()


def _logits(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=i, attention_mask=m).logits for i, m in batches])


def test_pruned_model_is_smaller_and_closer_to_the_original_than_plain_slicing():
    teacher = _tiny()
    calib, held_out = _batches(seed=0), _batches(seed=1)
    reference = _logits(teacher, held_out)
    student, report = prune_encoder(copy.deepcopy(teacher), calib, heads=2, ffn_width=96, progress=False)
    for layer in encoder_layers(student):
        assert layer.attention.self.query.out_features == 2 * 16
        assert layer.attention.output.dense.in_features == 2 * 16
        assert layer.intermediate.dense.out_features == 96 and layer.output.dense.in_features == 96
    assert student.config.intermediate_size == 96
    assert report["encoder_params_after"] < 0.6 * report["encoder_params_before"]
    assert len(report["heads_kept"]) == 2 and all(len(h) == 2 for h in report["heads_kept"])

    # the same heads and neurons, cut without repair: what the least squares must beat
    sliced = copy.deepcopy(teacher)
    for layer, kept in zip(encoder_layers(sliced), report["heads_kept"], strict=True):
        cols = torch.cat([torch.arange(h * 16, (h + 1) * 16) for h in kept])
        for lin in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
            lin.weight.data, lin.bias.data = lin.weight.data[cols], lin.bias.data[cols]
        out = layer.attention.output.dense
        out.weight.data = out.weight.data[:, cols]
        up, down = layer.intermediate.dense, layer.output.dense
        keep = torch.arange(96)
        up.weight.data, up.bias.data = up.weight.data[keep], up.bias.data[keep]
        down.weight.data = down.weight.data[:, keep]
    repaired_err = (_logits(student, held_out) - reference).abs().mean()
    sliced_err = (_logits(sliced, held_out) - reference).abs().mean()
    assert repaired_err < 0.5 * sliced_err


def test_nothing_pruned_means_the_same_function():
    teacher = _tiny()
    batches = _batches()
    student, report = prune_encoder(copy.deepcopy(teacher), batches, heads=None, ffn_width=None, progress=False)
    assert torch.allclose(_logits(student, batches), _logits(teacher, batches), atol=1e-6)
    assert report["encoder_params_after"] == report["encoder_params_before"]


def test_invalid_sizes_and_unsupported_models_fail_clearly():
    with pytest.raises(PruneError, match=r"prune.heads must be in \[1, 4\]"):
        prune_encoder(_tiny(), _batches(1), heads=5, ffn_width=None, progress=False)
    with pytest.raises(PruneError, match=r"prune.ffn_width must be in \[1, 256\]"):
        prune_encoder(_tiny(), _batches(1), heads=None, ffn_width=300, progress=False)
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    distil = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=2048, dim=32, n_layers=1, n_heads=2,
                                                                  hidden_dim=64))
    with pytest.raises(PruneError, match=r"BERT-style encoders.*distilbert.*prune\.enabled: false"):
        prune_encoder(distil, _batches(1), heads=1, ffn_width=None, progress=False)


