"""Unit: every variant built from a tiny BERT, parity, scoring, the TensorRT skip path and bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pipeline.core.params import EvaluateParams, ExportParams, QuantizeParams, TensorRTParams
from pipeline.deployment.inference import SentimentPredictor, softmax
from pipeline.evaluation.accuracy import check_targets, score_variants
from pipeline.modeling import ModelSourceError, load_finetuned
from pipeline.variants.export import ExportError, Parity, run_export
from pipeline.variants.quantize import run_quantize
from pipeline.variants.record import VariantError, read_variant
from pipeline.variants.runners import load_runner
from pipeline.variants.tensorrt import availability, profile_shapes, run_tensorrt
from tests.conftest import write_tokenized

NAMES = ["fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat", "tensorrt-fp16", "tensorrt-int8"]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    """All variants of the tiny model, plus tokenized synthetic data to score them on."""
    root = tmp_path_factory.mktemp("variants")
    tok_dir = write_tokenized(root / "tokenized", {"train": 64, "val": 32, "test": 48})
    dirs = {n: root / n for n in NAMES}
    export_report = run_export(tiny_model_dir, tok_dir, dirs, ExportParams(parity_samples=8))
    q = QuantizeParams(calibration_samples=32, selection_samples=32, qat_train_samples=32, qat_batch_size=8,
                       calibration_methods=["minmax", "entropy"])
    quant_report = run_quantize(tiny_model_dir, dirs["fp32-onnx"], tok_dir, dirs, q)
    trt_report = run_tensorrt(tiny_model_dir, dirs["fp32-onnx"], dirs["int8-static"], dirs, TensorRTParams(), 64)
    return {"dirs": dirs, "tokenized": tok_dir, "export": export_report, "quantize": quant_report, "trt": trt_report}


def test_fp32_exports_match_pytorch(built):
    for name in ("fp32-torchscript", "fp32-onnx"):
        assert built["export"][name]["parity_max_abs_diff"] <= 1e-4
        info = read_variant(built["dirs"][name])
        assert info.dtype == "float32" and info.status == "ok"


def test_variant_directories_describe_themselves(built):
    for name in NAMES:
        d = built["dirs"][name]
        info = json.loads((d / "variant.json").read_text())
        assert info["name"] == name and {"format", "dtype", "params", "status"} <= set(info)
        assert (d / "tokenizer.json").is_file() and (d / "pipeline.json").is_file()


def test_static_calibration_selected_by_validation(built):
    report = built["quantize"]["int8-static"]
    assert set(report["selection_val_accuracy"]) == {"minmax", "entropy"}
    best = max(report["selection_val_accuracy"].values())
    assert report["selection_val_accuracy"][report["calibration"]] == best


def test_single_calibration_method_skips_the_selection_pass(built, tmp_path):
    from pipeline.data.tokens import read_tokenized
    from pipeline.variants.quantize import _static_with_selection

    train = read_tokenized(built["tokenized"], "train")["input_ids"].tolist()[:16]
    val = read_tokenized(built["tokenized"], "val")
    params = QuantizeParams(calibration_samples=16, calibration_methods=["percentile"])
    best = _static_with_selection(built["dirs"]["fp32-onnx"] / "model.onnx", tmp_path, train, val, params, 0, None)
    assert best == {"method": "percentile", "scores": {}}
    assert (tmp_path / "static-percentile.onnx").is_file()


def test_every_weight_matmul_is_int8(built):
    """Static/QAT must quantize every weight product (a silent float fallback once hid here): QDQ with
    calibrated ranges, except the FFN down-projection, quantized per batch; the 2 attention products per
    layer (no weight operand) stay float."""
    for name in ("int8-static", "int8-qat"):
        report = built["quantize"][name]
        assert report["dynamic_ffn_output"] is True
        assert report["int8_matmuls"] == 2 * 6 + 2 and report["float_matmuls"] == 2 * 2, (name, report)


def test_static_with_calibrated_ffn_quantizes_every_weight_product_in_qdq(built, tmp_path):
    from pipeline.variants.onnx_int8 import ffn_output_matmuls, matmul_census, quantize_static_onnx

    src = built["dirs"]["fp32-onnx"] / "model.onnx"
    assert len(ffn_output_matmuls(src, 128)) == 2  # the tiny BERT's FFN is 128 wide: one per layer
    seqs = [np.arange(5, 5 + n) for n in (6, 9, 12, 20)]
    quantize_static_onnx(src, tmp_path / "all.onnx", seqs, "minmax")
    assert matmul_census(tmp_path / "all.onnx") == {"int8_matmuls": 2 * 6 + 2, "float_matmuls": 2 * 2}


def test_ffn_products_quantized_per_batch_with_int8_weights(built, tmp_path):
    """The FFN down-projections skip calibration: per-batch activation ranges, INT8 weights in the file."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from pipeline.variants.onnx_int8 import dynamic_int8_matmuls, ffn_output_matmuls
    from pipeline.variants.runners import OrtRunner

    for name in ("int8-static", "int8-qat"):
        graph = onnx.load(str(built["dirs"][name] / "model.onnx")).graph
        floats = [i.name for i in graph.initializer
                  if i.data_type == onnx.TensorProto.FLOAT and list(i.dims) == [128, 64]]
        assert floats == [], (name, floats)  # no [128 x 64] float FFN weight left
    src = built["dirs"]["fp32-onnx"] / "model.onnx"
    dst = tmp_path / "ffn-dynamic.onnx"
    ids = np.arange(10, 34).reshape(2, 12)
    mask = np.ones_like(ids)
    reference = OrtRunner(src)(ids, mask)
    assert dynamic_int8_matmuls(src, dst, ffn_output_matmuls(src, 128)) == 2
    graph = onnx.load(str(dst)).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    integer = [n for n in graph.node if n.op_type == "MatMulInteger"]
    assert len(integer) == 2 and all(weights[n.input[1]].dtype == np.int8 for n in integer)
    assert [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and weights[n.input[1]].shape == (128, 64)] == []
    # onnxruntime fuses each per-batch chain into one DynamicQuantizeMatMul when it loads the file.
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(dst), sess_options=opts, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert optimized.count("DynamicQuantizeMatMul") == 2 and "MatMulInteger" not in optimized
    assert np.abs(OrtRunner(dst)(ids, mask) - reference).max() < 5e-2


def test_dynamic_quantizes_the_fused_attention(built):
    """int8-dynamic starts from onnxruntime's fused graph: one QAttention per layer but the [CLS]-readout
    last one (plain MatMuls for its single query), parity checked."""
    import onnx

    report = built["quantize"]["int8-dynamic"]
    assert report["cls_readout"] is True
    assert report["fused_attention"] == 1 and report["fused_parity_max_abs_diff"] <= 1e-4
    graph = onnx.load(str(built["dirs"]["int8-dynamic"] / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QAttention") == 1 and "Attention" not in ops
    # fused layer: QKV, out, up, down; readout layer: Q, K, V, out, up, down (+ its 2 float activation
    # products); pooler and classifier
    assert report["float_matmuls"] == 2 and report["int8_matmuls"] == 4 + 6 + 2


def test_every_export_records_the_cls_readout(built):
    for name in ("fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat"):
        assert read_variant(built["dirs"][name]).params["cls_readout"] is True, name


def test_int8_weights_use_the_reduced_7_bit_range(built):
    """`quantize.reduce_range` (default on): every INT8 weight in every INT8 variant lies in [-64, 64]."""
    import onnx
    from onnx import numpy_helper

    for name in ("int8-dynamic", "int8-static", "int8-qat"):
        assert built["quantize"][name]["reduce_range"] is True
        graph = onnx.load(str(built["dirs"][name] / "model.onnx")).graph
        weights = [numpy_helper.to_array(i) for i in graph.initializer if i.data_type == onnx.TensorProto.INT8]
        big = [w.size for w in weights if w.size > 64]  # weight tensors, not zero points
        assert len(big) >= 2 * 4 + 2, (name, len(big))
        assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) <= 64, name


def test_seven_bit_weights_give_exact_int8_products():
    """Why the range is reduced: u8 x s8 products summed in pairs must fit int16 (AVX2 `vpmaddubsw` saturates
    there; on this project's AVX2 CPU 8-bit weights measured up to 26 % off). 7-bit weights are exact
    whatever the CPU, which is what this checks through onnxruntime's own kernel."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a = rng.integers(200, 256, (16, 256)).astype(np.uint8)  # large activations, like GELU outliers
    b = rng.integers(32, 65, (256, 32)).astype(np.int8)  # same-sign 7-bit weights: the worst case
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["A", "B"], ["Y"])], "g",
                              [helper.make_tensor_value_info("A", TensorProto.UINT8, list(a.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [16, 32])],
                              [numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    assert np.array_equal(y, a.astype(np.int64) @ b.astype(np.int64))


def test_qat_fake_quant_matches_the_reduced_weight_grid():
    import torch

    from pipeline.variants.qat import FakeQuantLinear

    torch.manual_seed(0)
    for reduce_range, qmax in ((True, 64), (False, 127)):
        layer = FakeQuantLinear(torch.nn.Linear(32, 8), reduce_range)
        layer(torch.randn(4, 32))  # observers see the weight once
        w = layer.linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / qmax
        levels = (layer.weight_fq(w) / scale).detach()
        assert torch.allclose(levels, levels.round(), atol=1e-3)
        assert levels.abs().max() <= qmax + 1e-3 and levels.abs().max() >= qmax - 1e-3


def test_qat_really_trained_with_fake_quant(built):
    report = built["quantize"]["int8-qat"]
    assert report["fake_quant_layers"] == 2 * 5 + 2  # 5 quantized Linear per layer x 2 layers + pooler + classifier
    assert report["qat_steps"] == 4


def test_scores_and_sizes(built, tiny_model_dir):
    results = score_variants(tiny_model_dir, built["dirs"], built["tokenized"], EvaluateParams(batch_size=16))
    assert results["fp32-onnx"]["agreement_with_fp32"] == 1.0
    assert results["fp32-torchscript"]["accuracy"] == results["fp32-eager"]["accuracy"]
    for name in ("int8-dynamic", "int8-static", "int8-qat"):
        assert results[name]["size_mb"] < 0.35 * results["fp32-onnx"]["size_mb"]
        assert 0.0 <= results[name]["agreement_with_fp32"] <= 1.0
    assert results["tensorrt-fp16"]["status"] == "skipped"
    lines = check_targets(results)
    assert any("int8-static" in line for line in lines)


def test_reference_row_reuses_the_finetune_logits_only_for_the_same_split(built, tiny_model_dir, tmp_path):
    from pipeline.core.io import write_predictions
    from pipeline.data.tokens import read_tokenized
    from pipeline.variants.runners import predict_logits

    params = EvaluateParams(batch_size=16)
    test = read_tokenized(built["tokenized"], "test")
    seqs, labels = test["input_ids"].tolist(), test["label"].to_numpy()
    logits = predict_logits(load_runner(tiny_model_dir), seqs, 16)
    saved = tmp_path / "finetune-test.npz"
    write_predictions(saved, logits, labels, seqs, seconds=1.5, batch_size=16)
    fresh = score_variants(tiny_model_dir, {"fp32-onnx": built["dirs"]["fp32-onnx"]}, built["tokenized"], params)
    reused = score_variants(tiny_model_dir, {"fp32-onnx": built["dirs"]["fp32-onnx"]}, built["tokenized"], params,
                            reference_predictions=saved)
    assert fresh["fp32-eager"]["scored_by"] == "evaluate" and reused["fp32-eager"]["scored_by"] == "finetune"
    for name in ("fp32-eager", "fp32-onnx"):
        assert reused[name]["accuracy"] == fresh[name]["accuracy"]
        assert reused[name]["agreement_with_fp32"] == fresh[name]["agreement_with_fp32"]
    assert reused["fp32-eager"]["eval_seconds"] == 1.5
    other_batches = score_variants(tiny_model_dir, {}, built["tokenized"], EvaluateParams(batch_size=8),
                                   reference_predictions=saved)  # scored differently: scored again
    assert other_batches["fp32-eager"]["scored_by"] == "evaluate"
    assert other_batches["fp32-eager"]["accuracy"] == fresh["fp32-eager"]["accuracy"]

    stale = tmp_path / "stale.npz"  # same reviews, one label changed: a different test split
    write_predictions(stale, logits, np.where(np.arange(len(labels)) == 0, 1 - labels, labels), seqs)
    with pytest.raises(VariantError, match="different test split"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=stale)
    other = tmp_path / "other.npz"  # one token changed
    write_predictions(other, logits, labels, [seqs[0][:-1], *seqs[1:]])
    with pytest.raises(VariantError, match="stale predictions"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=other)
    with pytest.raises(VariantError, match="not found"):
        score_variants(tiny_model_dir, {}, built["tokenized"], params, reference_predictions=tmp_path / "none.npz")


def test_qat_trains_on_the_finetune_window(tokenizer):
    from pipeline.data.tokens import encode_texts, training_window

    pre = {"max_length": 64, "truncation": "head_tail", "head_fraction": 0.25}
    text = " ".join(f"word{i}" for i in range(200))
    (full,) = encode_texts([text], tokenizer, 64, "head_tail", 0.25)
    (short,) = encode_texts([text], tokenizer, 24, "head_tail", 0.25)
    window = training_window({"preprocessing": pre, "params": {"train": {"max_length": 24}}}, tokenizer)
    assert window is not None and np.array_equal(window(full), short)
    assert training_window({"preprocessing": pre, "params": {"train": {"max_length": None}}}, tokenizer) is None
    assert training_window({"preprocessing": pre, "params": {"train": {"max_length": 64}}}, tokenizer) is None


def test_tensorrt_skip_record(built):
    ok, reason = availability()
    if ok:
        pytest.skip("a CUDA device with TensorRT is present: the engines were really built")
    for name in ("tensorrt-fp16", "tensorrt-int8"):
        info = read_variant(built["dirs"][name])
        assert info.status == "skipped" and info.reason == reason and info.file is None
        assert info.params["profile"]["max"] == [64, 64]
        with pytest.raises(VariantError, match="skipped"):
            load_runner(built["dirs"][name])


def test_profile_shapes_validated():
    s = profile_shapes(1, 8, 32, 8, 128, 256)
    assert s.min == (1, 8) and s.opt == (8, 128) and s.max == (32, 256)
    with pytest.raises(ValueError, match="min_batch"):
        profile_shapes(4, 2, 32, 8, 128, 256)
    with pytest.raises(ValueError, match="min_seq"):
        profile_shapes(1, 2, 32, 8, 512, 256)


def test_predictor_on_every_runnable_variant(built, tiny_model_dir):
    texts = ["great wonderful film", "awful boring film", "ok"]
    ref = SentimentPredictor(tiny_model_dir).predict(texts)
    for name in ("fp32-torchscript", "fp32-onnx"):
        got = SentimentPredictor(built["dirs"][name]).predict(texts)
        assert [p.label for p in got] == [p.label for p in ref]
        assert np.allclose([p.score for p in got], [p.score for p in ref], atol=1e-4)
    assert SentimentPredictor(built["dirs"]["int8-static"]).predict([]) == []


def test_softmax_is_stable():
    p = softmax(np.array([[1000.0, 0.0], [0.0, 0.0]]))
    assert np.allclose(p, [[1.0, 0.0], [0.5, 0.5]])


def test_missing_or_corrupt_inputs_name_the_file(tmp_path, tiny_model_dir, built):
    with pytest.raises(ModelSourceError, match=r"missing: .*config\.json"):
        load_finetuned(tmp_path)
    (tmp_path / "variant.json").write_text("{not json")
    with pytest.raises(VariantError, match=re.escape(str(tmp_path / "variant.json"))):
        read_variant(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"garbage")
    (broken / "variant.json").write_text(json.dumps({"name": "x", "format": "onnx", "dtype": "int8",
                                                     "file": "model.onnx"}))
    with pytest.raises(VariantError, match="cannot load"):
        load_runner(broken)


def test_parity_failure_stops_export(tmp_path, tiny_model_dir, monkeypatch):
    import pipeline.variants.export as build

    monkeypatch.setattr(build, "parity", lambda *a, **k: Parity(max_abs_diff=1.0, label_agreement=0.5, batch=1))
    tok_dir = write_tokenized(tmp_path / "tok", {"test": 8})
    dirs = {"fp32-torchscript": tmp_path / "ts", "fp32-onnx": tmp_path / "onnx"}
    with pytest.raises(ExportError, match="parity failed"):
        run_export(tiny_model_dir, tok_dir, dirs, ExportParams())


def test_qat_distillation_loss():
    import torch

    from pipeline.variants.qat import distillation_loss

    logits = torch.tensor([[2.0, -1.0], [0.5, 0.3]])
    labels = torch.tensor([1, 0])
    ce = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.isclose(distillation_loss(logits, logits + 5.0, labels, 0.0), ce)  # labels only
    assert distillation_loss(logits, logits, labels, 1.0).abs() < 1e-6  # already matches FP32: nothing to learn
    assert distillation_loss(logits, logits.flip(-1), labels, 1.0) > 0.1
    half = distillation_loss(logits, logits, labels, 0.5)
    assert torch.isclose(half, 0.5 * ce, atol=1e-6)


def test_qat_loss_is_labels_only_or_distilled(tiny_model_dir):
    """distillation 0 trains on cross-entropy (≈ ln 2 for an untrained head); 1 on KL to FP32 (≈ 0 at the start)."""
    import math

    from pipeline.modeling import load_finetuned
    from pipeline.variants.qat import qat_finetune

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=24) for _ in range(8)]
    labels = [i % 2 for i in range(8)]
    losses = {}
    for weight in (0.0, 1.0):
        model, _, _ = load_finetuned(tiny_model_dir)
        result = qat_finetune(model, seqs, labels, epochs=1, batch_size=4, lr=0.0, distillation=weight)
        assert result.steps == 2
        losses[weight] = result.final_loss
    assert abs(losses[0.0] - math.log(2)) < 0.2
    assert 0.0 <= losses[1.0] < 0.05
