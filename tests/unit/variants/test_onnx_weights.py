"""Unit: an exported graph refilled with another model's weights (`refill_weights`), as the quantize stage builds
int8-qat's graph from fp32-onnx's: the refilled graph answers like the new model, and a graph it cannot refill
safely (a tensor derived from a parameter, tensors that were equal and no longer are) is refused, nothing
written."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.variants.onnx_weights import refill_weights


def _tensors(model) -> dict[str, np.ndarray]:
    return {name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()}


def test_an_exported_graph_refilled_with_moved_weights_answers_like_the_moved_model(built, tiny_model_dir, tmp_path):
    """The tiny model as `built` exported it to fp32-onnx (readout as the default asks; its biases and layer-norm
    scales moved off their initial values, so no two of its tensors are equal, which the exporter would have kept as
    one initializer and `refill_weights` rightly refuses to split: the next test), every weight then moved (as QAT
    moves them): the refilled graph's logits are the moved model's, not the exported one's."""
    import torch

    from pipeline.core.params import ExportParams
    from pipeline.modeling import load_finetuned
    from pipeline.runtimes.base import pad_batch
    from pipeline.runtimes.ort import OrtRunner
    from pipeline.variants.export import eager_runner, inference_model

    model, _, _ = load_finetuned(tiny_model_dir)
    model.set_attn_implementation("eager")  # as run_export exports fp32-onnx
    exported = built["dirs"]["fp32-onnx"] / "model.onnx"
    before = _tensors(inference_model(model, ExportParams().cls_readout)[0])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    graph, _ = inference_model(model, ExportParams().cls_readout)
    dst = tmp_path / "refilled.onnx"
    replaced = refill_weights(exported, dst, before, _tensors(graph))
    assert replaced is not None and replaced >= sum(1 for _ in model.parameters()) - 2  # the pooler may go unused
    rng = np.random.default_rng(0)
    ids, mask = pad_batch([rng.integers(5, 100, size=n) for n in (7, 30, 64)], 0)
    want = eager_runner(model)(ids, mask)
    old = OrtRunner(exported, optimization="disable")(ids, mask)
    got = OrtRunner(dst, optimization="disable")(ids, mask)
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(old - want).max() > 1e-2  # the weights did move: the check above could fail


def _graph(path, initializers: dict[str, np.ndarray]) -> None:
    """x @ w1 + b (or whatever initializers are given), one Add per extra initializer."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    names = list(initializers)
    nodes = [helper.make_node("MatMul", ["x", names[0]], ["y0"])]
    for i, name in enumerate(names[1:], start=1):
        nodes.append(helper.make_node("Add", [f"y{i - 1}", name], [f"y{i}"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info(f"y{len(names) - 1}", TensorProto.FLOAT, [1, 3])],
                              [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    onnx.save(helper.make_model(graph), str(path))


def test_a_transposed_weight_and_a_scalar_constant_refill(tmp_path):
    import onnx
    from onnx import numpy_helper

    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    b = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    _graph(tmp_path / "g.onnx", {"val_7": w.T.copy(), "lin.bias": b, "val_9": np.array(0.5, dtype=np.float32)})
    new = {"lin.weight": w + 1, "lin.bias": b * 2}
    assert refill_weights(tmp_path / "g.onnx", tmp_path / "r.onnx", {"lin.weight": w, "lin.bias": b}, new) == 2
    got = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "r.onnx")).graph.initializer}
    assert np.array_equal(got["val_7"], (w + 1).T) and np.array_equal(got["lin.bias"], b * 2)
    assert got["val_9"] == np.float32(0.5)  # the graph's own constant, untouched


@pytest.mark.parametrize("case", ["derived", "ambiguous", "renamed", "reshaped"])
def test_a_graph_that_cannot_be_refilled_safely_is_refused_and_nothing_written(tmp_path, case):
    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    b = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    exported, new = {"w": w, "b": b}, {"w": w + 1, "b": b + 1}
    graph = {"w": w, "b": b}
    if case == "derived":  # a constant folded from a parameter: its new value is unknown
        graph = {"w": w, "b2": b * 2}
    elif case == "ambiguous":  # two tensors equal when exported, different now: which one does the graph hold?
        exported, new = {"w": w, "b": b, "c": b.copy()}, {"w": w, "b": b, "c": b + 1}
    elif case == "renamed":
        new = {"w": w, "bias": b}
    else:
        new = {"w": w, "b": np.ones(4, dtype=np.float32)}
    _graph(tmp_path / "g.onnx", graph)
    assert refill_weights(tmp_path / "g.onnx", tmp_path / "r.onnx", exported, new) is None
    assert not (tmp_path / "r.onnx").exists()
