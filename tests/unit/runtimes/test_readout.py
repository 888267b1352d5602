"""Unit: the [CLS] readout computes the same logits with a last layer that serves one position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.runtimes.readout import ClsOnlyLayer, ReadoutError, cls_readout, unsupported


def _tiny(attn: str = "eager", layers: int = 2, hidden: int = 64) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=2048, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=2 * hidden, num_labels=2)
    model = BertForSequenceClassification(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 2000, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 3:] = 0
    return ids * mask, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_readout_gives_the_same_logits_on_padded_batches(attn):
    model = _tiny(attn)
    ids, mask = _padded()
    readout = cls_readout(model)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        fast = readout(input_ids=ids, attention_mask=mask).logits
        hidden = readout.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(full, fast, atol=1e-5), (full - fast).abs().max()
    assert hidden.shape == (3, 1, 64)  # the last layer returned the [CLS] position only
    # the padding is really masked: a different pad token changes nothing
    with torch.no_grad():
        other = readout(input_ids=torch.where(mask.bool(), ids, torch.full_like(ids, 7)), attention_mask=mask).logits
    assert torch.allclose(other, fast, atol=1e-5)


def test_readout_is_a_copy_and_only_the_last_layer_changes():
    model = _tiny(layers=3)
    readout = cls_readout(model)
    kinds = [type(layer).__name__ for layer in readout.bert.encoder.layer]
    assert kinds == ["BertLayer", "BertLayer", "ClsOnlyLayer"]
    assert all(type(layer).__name__ == "BertLayer" for layer in model.bert.encoder.layer)


def test_readout_follows_pruned_head_counts():
    """A layer with fewer heads (as `pipeline.surgery.prune` leaves them) is read from its own projection sizes."""
    model = _tiny()
    last = model.bert.encoder.layer[-1]
    keep = torch.arange(32)  # 2 of the 4 16-wide heads
    for lin in (last.attention.self.query, last.attention.self.key, last.attention.self.value):
        lin.weight.data, lin.bias.data = lin.weight.data[keep], lin.bias.data[keep]
        lin.out_features = 32
    dense = last.attention.output.dense
    dense.weight.data, dense.in_features = dense.weight.data[:, keep], 32
    last.attention.self.num_attention_heads, last.attention.self.all_head_size = 2, 32
    assert ClsOnlyLayer(last).heads == 2
    ids, mask = _padded()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits,
                              cls_readout(model)(input_ids=ids, attention_mask=mask).logits, atol=1e-5)


def test_heads_that_read_every_position_are_refused():
    from pipeline.modeling import mean_pool_classes, tiny_bert_config

    _, mean_model = mean_pool_classes()
    model = mean_model(tiny_bert_config(head="mean"))
    assert "BertForMeanPooledClassification" in unsupported(model)
    with pytest.raises(ReadoutError, match="BertForSequenceClassification"):
        cls_readout(model)


def test_inference_model_records_what_was_exported():
    from pipeline.variants.export import inference_model

    model = _tiny()
    graph, record = inference_model(model, True)
    assert record == {"cls_readout": True} and graph is not model
    graph, record = inference_model(model, False)
    assert graph is model and record == {"cls_readout": False, "cls_readout_reason": "export.cls_readout is false"}


# The pipeline exports every ONNX graph it fuses in eager attention (`fused_graph`, `run_export`); that sdpa fuses
# the same is checked in the slow tier.
@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.slow)])
def test_readout_onnx_fuses_the_other_layers_and_keeps_parity(tmp_path, attn):
    """The graph INT8 builds start from (torch.export-based, fused by onnxscript): every attention but the readout
    layer's is one `Attention` op fed the padding mask as `mask_index` and its packed Q/K/V weight as one
    initializer (128 wide: over the rewriter's default constant-folding size), and the logits are unchanged."""
    import onnx

    from pipeline.core.params import ExportParams
    from pipeline.runtimes.ort import OrtRunner
    from pipeline.variants.export import export_onnx
    from pipeline.variants.fusion import optimize_for_quantization

    model = _tiny(attn, layers=3, hidden=128)
    export_onnx(cls_readout(model), tmp_path / "raw.onnx", 64, ExportParams().opset)
    counts = optimize_for_quantization(tmp_path / "raw.onnx", tmp_path / "fused.onnx")
    assert counts["Attention"] == 2
    graph = onnx.load(str(tmp_path / "fused.onnx")).graph
    attention = [n for n in graph.node if n.op_type == "Attention"]
    assert [list(n.input[3:]) for n in attention] == [["attention_mask_index"]] * 2  # no additive bias left
    weights = {i.name: list(i.dims) for i in graph.initializer}
    assert [weights.get(n.input[1]) for n in attention] == [[128, 3 * 128]] * 2
    ids, mask = _padded()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits.numpy()
    got = OrtRunner(tmp_path / "fused.onnx")(ids.numpy(), mask.numpy())
    assert np.abs(got - reference).max() < 1e-4
