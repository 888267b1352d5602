"""An exported ONNX graph refilled with the weights of another model of the same architecture: the QAT model's
graph is fp32-onnx's graph with the QAT weights put in, instead of a second `torch.onnx.export` (the costliest
step of building a variant).

The torch.export-based exporter names most initializers after their parameters but folds others (a Linear's
transposed weight becomes `val_<n>`), so an initializer is matched to the exported model's tensor it holds by
value, as it is or transposed, and gets the other model's tensor in the same orientation. Names cannot settle
which of several equal tensors an initializer holds: the exporter keeps one initializer for equal constants, fed
to every node that read any of them. An initializer that
matches nothing is a constant of the graph's own (a shape, a scale) when it has one element; a larger float one
that matches nothing (a tensor derived from a parameter), or one that matches tensors whose new values differ,
means the graph cannot be refilled safely: nothing is written and the caller exports instead. The caller still
checks the refilled graph against the new model on real reviews (`pipeline.variants.fusion.fuse_export`)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _key(array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
    return str(array.dtype), tuple(array.shape), hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()


def refill_weights(src: Path, dst: Path, exported: Mapping[str, np.ndarray],
                   new: Mapping[str, np.ndarray]) -> int | None:
    """Write `dst`: the graph of `src` (exported from a model whose tensors are `exported`, by name) with each
    initializer that holds one of those tensors, as it is or transposed, replaced by the tensor of `new` with the
    same name in the same orientation. Returns how many initializers were replaced, or None, writing nothing, when
    the graph cannot be refilled (see the module's docstring; the reason is logged)."""
    import onnx
    from onnx import numpy_helper

    if exported.keys() != new.keys():
        log.warning("cannot refill %s: the two models' tensors differ in name", src)
        return None
    index: dict[tuple[str, tuple[int, ...], str], list[tuple[str, bool]]] = {}
    for name, array in exported.items():
        if new[name].shape != array.shape or new[name].dtype != array.dtype:
            log.warning("cannot refill %s: %s is %s %s in one model and %s %s in the other", src, name,
                        array.dtype, array.shape, new[name].dtype, new[name].shape)
            return None
        index.setdefault(_key(array), []).append((name, False))
        if array.ndim == 2:
            index.setdefault(_key(array.T), []).append((name, True))
    model = onnx.load(str(src))
    replaced = 0
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        found = index.get(_key(value), [])
        if not found:
            if value.size > 1 and np.issubdtype(value.dtype, np.floating):
                log.warning("cannot refill %s: initializer %s %s holds no tensor of the model (derived from one?)",
                            src, init.name, value.shape)
                return None
            continue  # a constant of the graph's own
        candidates = [new[name].T if transposed else new[name] for name, transposed in found]
        if any(not np.array_equal(candidates[0], c) for c in candidates[1:]):
            log.warning("cannot refill %s: initializer %s equals %s in the exported model, which differ in the "
                        "other", src, init.name, ", ".join(name for name, _ in found))
            return None
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(candidates[0]), init.name))
        replaced += 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return replaced
