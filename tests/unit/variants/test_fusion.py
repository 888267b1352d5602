"""Unit: the edits that make onnxscript's fused `Attention` ops quantizable into `QAttention`."""

from __future__ import annotations


def _attention_graph():
    """Two fused `Attention` ops: one biased by a float copy of `attention_mask`, one by another graph input."""
    import onnx_ir as ir

    x = ir.val("x", ir.DataType.FLOAT, ["batch", "sequence", 8])
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "sequence"])
    other = ir.val("relative_bias", ir.DataType.FLOAT, ["batch", 2, "sequence", "sequence"])
    weight = ir.val("weight", ir.DataType.FLOAT, [8, 24])
    bias = ir.val("bias", ir.DataType.FLOAT, [24])
    cast = ir.node("Cast", [mask], {"to": ir.DataType.FLOAT})
    padding_bias = ir.node("Unsqueeze", [cast.outputs[0], ir.Value(name="axes")])
    nodes = [cast, padding_bias]
    outputs = []
    for i, attention_bias in enumerate((padding_bias.outputs[0], other)):
        node = ir.node("Attention", [x, weight, bias, None, None, attention_bias],
                       {"num_heads": 2, "qkv_hidden_sizes": [8, 8, 8]}, domain="com.microsoft", name=f"attention{i}")
        nodes.append(node)
        outputs.append(node.outputs[0])
    graph = ir.Graph([x, mask, other, weight, bias], outputs, nodes=nodes, opset_imports={"": 18, "com.microsoft": 1})
    return ir.Model(graph, ir_version=10)


def test_only_a_bias_made_from_the_padding_mask_becomes_mask_index():
    from pipeline.variants.fusion import padding_mask_as_mask_index

    model = _attention_graph()
    assert padding_mask_as_mask_index(model) == 1
    first, second = (n for n in model.graph if n.op_type == "Attention")
    mask_index = first.inputs[3].producer()
    assert mask_index.op_type == "Cast" and mask_index.inputs[0].name == "attention_mask"
    assert len(first.inputs) < 6 or first.inputs[5] is None  # the additive bias is gone
    assert second.inputs[3] is None and second.inputs[5].name == "relative_bias"  # not a padding mask: kept
    # equal Q/K/V widths are the op's default: the attribute that keeps the quantizer off is dropped
    assert all("qkv_hidden_sizes" not in n.attributes for n in (first, second))
    assert "Unsqueeze" not in [n.op_type for n in model.graph]  # the float mask feeds nothing now


def test_a_fused_graph_is_checked_as_the_export_stage_checks_parity():
    """One source for the fused graphs' check: `export.parity_samples` validation reviews, `export.parity_tolerance`."""
    import numpy as np

    from pipeline.core.params import ExportParams
    from pipeline.variants.fusion import FusionCheck

    val_ids = [np.arange(2, 2 + n) for n in range(3, 40)]
    check = FusionCheck.of(lambda ids, mask: ids, "ref", num_layers=2, max_length=64, val_ids=val_ids, pad_id=0,
                           export=ExportParams(parity_samples=5, parity_tolerance=3e-5))
    assert [len(r) for r in check.reviews] == [3, 4, 5, 6, 7]
    assert check.tolerance == 3e-5
