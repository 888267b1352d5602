"""Structured pruning of a finetuned encoder: whole attention heads and FFN neurons, repaired by least squares.

Why: on CPUs without VNNI/AMX, onnxruntime's INT8 matrix products gain little over its FP32 ones
(`benchmarks/int8_gemm_ceiling.py` measures it; figures in RESULTS.md), so INT8 alone cannot reach the
`targets.min_speedup` over FP32 eager there. Fewer FLOPs can. Pruning
whole heads and neurons keeps the model dense (smaller matrices, same kernels), so every runtime gains.

How (no retraining, a few hundred calibration reviews): layer by layer, for the attention output projection
and then the FFN down projection, the pruned model's own inputs are regressed on what the *unpruned*
model adds to the residual stream there (its sum before the LayerNorm, minus the pruned model's residual),
so each layer also absorbs the drift that earlier pruning caused. Which heads/neurons go is chosen by
Optimal Brain Surgeon on the Gram matrix (remove the group whose loss raises the least-squares error least,
update the solution, repeat); the kept columns then get the exact ridge least-squares weights. This is the
post-training recipe of Kwon et al., "A Fast Post-Training Pruning Framework for Transformers" (2022),
with OBS selection in place of their Fisher mask search."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtimes.base import length_sorted_batches
from pipeline.surgery.errors import PruneError
from pipeline.surgery.least_squares import GramAccumulator, obs_select, relative_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BlockNames:
    """Where one architecture keeps the pieces the pruner touches, relative to one encoder layer."""

    query: str
    key: str
    value: str
    attention_out: str
    attention_norm: str
    ffn_up: str
    ffn_down: str
    ffn_norm: str


# BERT-style encoders (BERT, all-MiniLM, RoBERTa-likes with the same module names). Others fail clearly.
BERT_NAMES = BlockNames(query="attention.self.query", key="attention.self.key", value="attention.self.value",
                        attention_out="attention.output.dense", attention_norm="attention.output.LayerNorm",
                        ffn_up="intermediate.dense", ffn_down="output.dense", ffn_norm="output.LayerNorm")


def encoder_layers(model: Any) -> list[torch.nn.Module]:
    """The encoder layers of a supported model, or a PruneError that says which models are supported."""
    base = getattr(model, "base_model", model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None or not all(_has(layer, BERT_NAMES) for layer in layers):
        raise PruneError(f"pruning supports BERT-style encoders (model_type bert); got "
                         f"{getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)!r}: "
                         "set prune.enabled: false for this model")
    return list(layers)


def _has(layer: torch.nn.Module, names: BlockNames) -> bool:
    try:
        for name in vars(names).values():
            layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _set(layer: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, child, module)


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    out = torch.nn.Linear(weight.shape[1], weight.shape[0])
    out.weight.data = weight.to(torch.float32).contiguous()
    out.bias.data = bias.to(torch.float32).contiguous()
    return out


@contextmanager
def _recording(layer: torch.nn.Module, linear: str, norm: str, store: dict[str, torch.Tensor]) -> Iterator[None]:
    """Record a residual branch: the projection's input (`x`), and the sum the LayerNorm receives (`sum`)
    with the projection's own output taken back out (`residual`)."""
    lin, ln = layer.get_submodule(linear), layer.get_submodule(norm)

    def on_linear(mod: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        store["x"], store["proj"] = args[0].detach(), out.detach()

    def on_norm(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
        store["sum"] = args[0].detach()
        store["residual"] = store["sum"] - store["proj"]

    handles = [lin.register_forward_hook(on_linear), ln.register_forward_pre_hook(on_norm)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class LayerInputs:
    """What a layer is called with for one calibration batch (hidden states, the rest as the encoder passed it)."""

    hidden: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mask: torch.Tensor


def prune_encoder(model: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], heads: int | None,
                  ffn_width: int | None, damp: float = 1e-3,
                  progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """A pruned copy of `model` with `heads` attention heads and `ffn_width` FFN neurons in every layer.

    `batches` are (input_ids, attention_mask) calibration batches. `None` keeps that dimension whole.
    The copy computes with smaller matrices; its config keeps the original head count (per-layer head
    counts are not expressible in a BERT config), so it is exported, not saved with `save_pretrained`.
    """
    teacher = model.eval()
    t_layers = encoder_layers(teacher)
    cfg = teacher.config
    n_heads, head_dim = int(cfg.num_attention_heads), int(cfg.hidden_size) // int(cfg.num_attention_heads)
    width = int(cfg.intermediate_size)
    if heads is not None and not 1 <= heads <= n_heads:
        raise PruneError(f"prune.heads must be in [1, {n_heads}], got {heads}")
    if ffn_width is not None and not 1 <= ffn_width <= width:
        raise PruneError(f"prune.ffn_width must be in [1, {width}], got {ffn_width}")
    started = time.perf_counter()
    student = copy.deepcopy(teacher).eval()
    s_layers = encoder_layers(student)
    names = BERT_NAMES

    # One pass of the unpruned model: each layer's two pre-LayerNorm sums (the targets) per batch, and what
    # the first layer is called with (so the pruned layers can be run one at a time on cached inputs).
    targets: list[list[dict[str, torch.Tensor]]] = [[] for _ in t_layers]
    inputs: list[LayerInputs] = []
    with torch.no_grad():
        for ids, mask in batches:
            stores = [({}, {}) for _ in t_layers]

            def first(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      mask: torch.Tensor = mask) -> None:
                inputs.append(LayerInputs(args[0].detach(), args[1:], dict(kwargs), mask))

            hook = t_layers[0].register_forward_pre_hook(first, with_kwargs=True)
            try:
                with _all_recording(t_layers, names, stores):
                    teacher(input_ids=ids, attention_mask=mask)
            finally:
                hook.remove()
            for i, (att, ffn) in enumerate(stores):
                targets[i].append({"attention": att["sum"], "ffn": ffn["sum"]})

    report: dict[str, Any] = {"heads_kept": [], "attention_rel_error": [], "ffn_rel_error": []}
    hidden = [b.hidden for b in inputs]
    for li, layer in enumerate(_bar(s_layers, progress)):
        if heads is not None and heads < n_heads:
            acc, target_sq = _branch_stats(layer, hidden, inputs, [t["attention"] for t in targets[li]],
                                           (names.attention_out, names.attention_norm))
            groups = [list(range(h * head_dim, (h + 1) * head_dim)) for h in range(n_heads)]
            kept, w = obs_select(acc.gram, acc.cross, groups, heads, damp)
            cols = torch.tensor([c for h in kept for c in groups[h]])
            for name in (names.query, names.key, names.value):
                lin = layer.get_submodule(name)
                _set(layer, name, _linear(lin.weight.data[cols], lin.bias.data[cols]))
            _set(layer, names.attention_out, _linear(w[:-1].T, w[-1]))
            report["heads_kept"].append(kept)
            report["attention_rel_error"].append(
                relative_error(acc.gram, acc.cross, target_sq, _with_intercept(cols, acc.gram.shape[0]), w))
        if ffn_width is not None and ffn_width < width:
            acc, target_sq = _branch_stats(layer, hidden, inputs, [t["ffn"] for t in targets[li]],
                                           (names.ffn_down, names.ffn_norm))
            kept, w = obs_select(acc.gram, acc.cross, [[i] for i in range(width)], ffn_width, damp)
            cols = torch.tensor(kept)
            up = layer.get_submodule(names.ffn_up)
            _set(layer, names.ffn_up, _linear(up.weight.data[cols], up.bias.data[cols]))
            _set(layer, names.ffn_down, _linear(w[:-1].T, w[-1]))
            report["ffn_rel_error"].append(relative_error(acc.gram, acc.cross, target_sq,
                                                          _with_intercept(cols, acc.gram.shape[0]), w))
        hidden = [out["output"] for out in _run_layer(layer, hidden, inputs, None)]
    if ffn_width is not None:
        student.config.intermediate_size = ffn_width
    report.update(heads=heads or n_heads, ffn_width=ffn_width or width, original_heads=n_heads,
                  original_ffn_width=width, calibration_tokens=int(sum(int(b.mask.sum()) for b in inputs)),
                  encoder_params_before=_params(t_layers), encoder_params_after=_params(s_layers),
                  prune_seconds=round(time.perf_counter() - started, 2))
    log.info("pruned to %s heads and %s FFN neurons per layer in %.1f s (encoder parameters %d -> %d)",
             report["heads"], report["ffn_width"], report["prune_seconds"], report["encoder_params_before"],
             report["encoder_params_after"])
    return student, report


def _run_layer(layer: torch.nn.Module, hidden: Sequence[torch.Tensor], inputs: Sequence[LayerInputs],
               capture: tuple[str, str] | None) -> list[dict[str, torch.Tensor]]:
    """Run one layer on cached inputs, batch by batch: its outputs (`capture` None) or one residual branch."""
    out: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for h, b in zip(hidden, inputs, strict=True):
            store: dict[str, torch.Tensor] = {}
            if capture is None:
                store["output"] = layer(h, *b.args, **b.kwargs)
            else:
                with _recording(layer, capture[0], capture[1], store):
                    layer(h, *b.args, **b.kwargs)
            out.append(store)
    return out


def _branch_stats(layer: torch.nn.Module, hidden: Sequence[torch.Tensor], inputs: Sequence[LayerInputs],
                  targets: Sequence[torch.Tensor], capture: tuple[str, str]) -> tuple[GramAccumulator, float]:
    """Least-squares statistics of one residual branch of the pruned layer: its projection's inputs against
    what the unpruned model's branch sum needs from it given the pruned model's own residual (drift included),
    and the target's squared norm (for the relative error)."""
    rec = _run_layer(layer, hidden, inputs, capture)
    acc = GramAccumulator(rec[0]["x"].shape[-1], rec[0]["sum"].shape[-1])
    target_sq = 0.0
    for r, t, b in zip(rec, targets, inputs, strict=True):
        y = t - r["residual"]
        acc.add(r["x"], y, b.mask)
        target_sq += float((y[b.mask.bool()].double() ** 2).sum())
    return acc, target_sq


def _with_intercept(cols: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([cols, torch.tensor([n - 1])])


def _params(layers: Sequence[torch.nn.Module]) -> int:
    return sum(p.numel() for layer in layers for p in layer.parameters())


@contextmanager
def _all_recording(layers: Sequence[torch.nn.Module], names: BlockNames,
                   stores: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]) -> Iterator[None]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        for layer, (att, ffn) in zip(layers, stores, strict=True):
            stack.enter_context(_recording(layer, names.attention_out, names.attention_norm, att))
            stack.enter_context(_recording(layer, names.ffn_down, names.ffn_norm, ffn))
        yield


def _bar(layers: Sequence[torch.nn.Module], progress: bool) -> Any:
    if not progress:
        return layers
    from tqdm.auto import tqdm

    return tqdm(layers, desc="prune", unit="layer")


def calibration_batches(seqs: Sequence[Any], *, batch_size: int,
                        pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(input_ids, attention_mask)` tensors for `prune_encoder`, in `length_sorted_batches`."""
    return [(torch.from_numpy(ids), torch.from_numpy(mask))
            for ids, mask in length_sorted_batches(seqs, batch_size=batch_size, pad_id=pad_id)]
