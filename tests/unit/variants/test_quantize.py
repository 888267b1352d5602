"""Unit: the `quantize` stage's INT8 builds of a tiny BERT: calibration selection, every weight product in
INT8, the fused attention, the weight format the CPU needs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.core.params import ExportParams, Params, QuantizeParams, TrainParams
from pipeline.runtimes.record import read_variant
from pipeline.variants.quantize import run_quantize
from tests.factories import product_weights, qat_precision_here, weight_format_here


def test_static_calibration_selected_by_validation(built):
    report = built["quantize"]["int8-static"]
    assert set(report["selection_val_accuracy"]) == {"minmax", "entropy"}
    best = max(report["selection_val_accuracy"].values())
    assert report["selection_val_accuracy"][report["calibration"]] == best


def test_a_profile_opting_out_builds_the_rest_with_one_export_and_records_the_others_as_skipped(
        built, tiny_model_dir, tmp_path, monkeypatch):
    """The default profile builds all five INT8 variants (PTQ dynamic, OpenVINO, PTQ static, QAT for onnxruntime
    and for OpenVINO; the `built` fixture). A profile that opts out of some for speed still builds the rest, and
    each left out is a skipped variant whose reason names the setting that builds it.

    Static and QAT start from fp32-onnx fused as the export stage wrote it (in eager attention); QAT puts its
    weights into that graph (`built`'s int8-qat did), and only where the graph cannot be refilled (forced here) is
    the QAT model exported, once, at `export.opset` (17 here, the default 18). With one calibration method there is
    nothing to choose: no validation pass is spent (no selection scores), and int8-static and int8-qat are both
    calibrated with that method."""
    import onnx

    import pipeline.variants.fusion as fusion
    import pipeline.variants.onnx_weights as onnx_weights

    assert built["quantize"]["int8-qat"]["qat_graph"] == "fp32-onnx's graph with the QAT weights"
    monkeypatch.setattr(onnx_weights, "refill_weights", lambda *args: None)  # as for a graph it cannot refill

    assert sorted(QuantizeParams().build) == ["int8-dynamic", "int8-openvino", "int8-qat", "int8-qat-openvino",
                                              "int8-static"]
    assert read_variant(built["dirs"]["fp32-onnx"]).params["attention"] == "eager"
    exports, opsets = [], []
    real_export = fusion.export_onnx

    def export(*args: object, **kwargs: object) -> None:
        exports.append(args[1])
        real_export(*args, **kwargs)
        opsets.append({o.domain: o.version for o in onnx.load(args[1]).opset_import}[""])

    monkeypatch.setattr(fusion, "export_onnx", export)
    params = QuantizeParams(calibration_samples=16, calibration_methods=["percentile"], qat_train_samples=8,
                            qat_batch_size=8, build=["int8-static", "int8-qat"])
    report = run_quantize(finetuned=tiny_model_dir, fp32_onnx=built["dirs"]["fp32-onnx"], tokenized=built["tokenized"],
                          variants_root=tmp_path, choice=weight_format_here(), qat_precision=qat_precision_here(),
                          params=Params(quantize=params, train=TrainParams(checkpoint_dir=str(tmp_path / "ckpt")),
                                        export=ExportParams(opset=17)))
    assert len(exports) == 1 and opsets == [17], exports
    assert report["int8-qat"]["qat_graph"] == "exported from the QAT model"
    for name in ("int8-static", "int8-qat"):
        assert report[name]["calibration"] == "percentile" and report[name]["fused_attention"] >= 1
        assert read_variant(tmp_path / name).status == "ok" and (tmp_path / name / "model.onnx").is_file()
    assert report["int8-static"]["selection_val_accuracy"] == {}
    for name in ("int8-dynamic", "int8-openvino", "int8-qat-openvino"):
        info = read_variant(tmp_path / name)
        assert info.status == "skipped" and "quantize.build" in info.reason, name
        assert report[name] == {"status": "skipped", "reason": info.reason}
        assert not any((tmp_path / name).glob("model.*"))


@pytest.mark.parametrize("variant", ["int8-qat", "int8-qat-openvino"])
def test_a_training_variants_checkpoints_stay_until_it_is_published(built, tiny_model_dir, tmp_path, monkeypatch,
                                                                    variant):
    """The stage removes a QAT variant's checkpoints only once its directory is published: a build that fails
    after training (as a kill in the conversion would stop it) leaves them for the rerun to resume."""
    import shutil

    import pipeline.variants.quantize as quantize
    from pipeline.training.checkpoints import CheckpointStore
    from pipeline.variants.onnx_int8 import QuantizeError

    train = TrainParams(checkpoint_dir=str(tmp_path / "ckpt"))
    store = CheckpointStore.for_job(train, quantize.CHECKPOINT_JOBS[variant])

    def trained_then(fail: bool):
        def build(inputs, out):
            store.dir.mkdir(parents=True, exist_ok=True)
            (store.dir / "step=3.ckpt").write_bytes(b"as the training left it")
            if fail:
                raise QuantizeError("the conversion was stopped")
            if variant == "int8-qat":  # its record reads the ONNX file: any valid one will do
                shutil.copy(built["dirs"]["fp32-onnx"] / "model.onnx", out / "model.onnx")
            else:
                (out / "model.xml").write_text("<net/>")
            return {}
        return build

    def run() -> None:
        run_quantize(finetuned=tiny_model_dir, fp32_onnx=built["dirs"]["fp32-onnx"], tokenized=built["tokenized"],
                     variants_root=tmp_path / "variants", choice=weight_format_here(),
                     qat_precision=qat_precision_here(),
                     params=Params(quantize=QuantizeParams(build=[variant]), train=train))

    monkeypatch.setitem(quantize.BUILDERS, variant, trained_then(fail=True))
    with pytest.raises(QuantizeError, match="stopped"):
        run()
    assert (store.dir / "step=3.ckpt").is_file()
    monkeypatch.setitem(quantize.BUILDERS, variant, trained_then(fail=False))
    run()
    assert read_variant(tmp_path / "variants" / variant).status == "ok" and not store.dir.exists()


@pytest.mark.slow  # two real QAT builds; the stage's ordering is checked in `make test` by the one above
def test_a_qat_build_killed_after_training_resumes_and_its_checkpoints_go_once_published(
        built, tiny_model_dir, tmp_path, monkeypatch):
    """int8-qat's checkpoints outlive its training: a conversion that fails (as a kill would stop it) leaves them,
    the rerun resumes instead of training again, also with settings QAT does not read changed (`quantize.build`),
    and they go only once the variant is published."""
    import pipeline.variants.onnx_qat as onnx_qat
    from pipeline.training.checkpoints import CheckpointStore
    from pipeline.variants.onnx_int8 import QuantizeError

    train = TrainParams(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every_n_steps=1)
    store = CheckpointStore.for_job(train, onnx_qat.CHECKPOINT_JOB)

    def run(build: list[str]) -> dict:
        params = QuantizeParams(calibration_samples=16, calibration_methods=["percentile"], qat_train_samples=8,
                                qat_batch_size=4, build=build)
        return run_quantize(finetuned=tiny_model_dir, fp32_onnx=built["dirs"]["fp32-onnx"],
                            tokenized=built["tokenized"], variants_root=tmp_path / "variants",
                            choice=weight_format_here(), qat_precision=qat_precision_here(),
                            params=Params(quantize=params, train=train))

    def killed(*args, **kwargs):
        raise QuantizeError("the conversion was stopped")

    real = onnx_qat.quantize_static_onnx
    monkeypatch.setattr(onnx_qat, "quantize_static_onnx", killed)
    with pytest.raises(QuantizeError, match="stopped"):
        run(["int8-qat"])
    assert [step for step, _ in store.checkpoints()] == [2]
    assert not (tmp_path / "variants" / "int8-qat" / "model.onnx").exists()
    monkeypatch.setattr(onnx_qat, "quantize_static_onnx", real)
    report = run(["int8-qat", "int8-dynamic"])["int8-qat"]
    assert report["qat_resumed"] is True and report["qat_resumed_from_step"] == 2 and report["qat_steps"] == 2
    assert read_variant(tmp_path / "variants" / "int8-qat").status == "ok"
    assert not store.dir.exists()


def test_an_unknown_build_name_is_a_params_error():
    from pipeline.core.params import ParamsError

    with pytest.raises(ParamsError, match=r"quantize\.build"):
        QuantizeParams(build=["int8-dynamic", "int8-fancy"])


def test_every_weight_matmul_is_int8(built):
    """Static/QAT must quantize every weight product (a silent float fallback once hid here): QDQ with
    calibrated ranges, except the FFN down-projection, quantized per batch; the 2 attention products per
    layer (no weight operand) stay float, inside `QAttention` (or the readout layer's `MultiHeadAttention`). They
    start from int8-dynamic's fused graph: the fused layer's Q/K/V is one packed product (QKV, out, up, down),
    the readout layer's are three (Q, K, V, out, up, down); the head (pooler, classifier) stays float."""
    for name in ("int8-static", "int8-qat"):
        report = built["quantize"][name]
        assert report["dynamic_ffn_output"] is True and report["fused_graph"] is True
        # as int8-dynamic's census: the readout layer's 2 float products (in `MultiHeadAttention`); QAttention's
        # own 2 are inside the INT8 op
        assert report["int8_matmuls"] == 4 + 6 and report["float_matmuls"] == 2 + 2, (name, report)


def test_dynamic_quantizes_the_fused_attention(built):
    """int8-dynamic starts from the torch.export-based graph fused for onnxruntime: one QAttention per layer but
    the [CLS]-readout last one (plain MatMuls for its single query), parity checked, padding masked."""
    import onnx

    report = built["quantize"]["int8-dynamic"]
    assert report["cls_readout"] is True
    assert report["fused_attention"] == 1 and report["fused_parity_max_abs_diff"] <= 1e-4
    graph = onnx.load(str(built["dirs"]["int8-dynamic"] / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QAttention") == 1 and "Attention" not in ops and ops.count("MultiHeadAttention") == 1
    producer = {out: n for n in graph.node for out in n.output}
    mask_index = producer[next(n for n in graph.node if n.op_type == "QAttention").input[5]]
    assert mask_index.op_type == "Cast" and list(mask_index.input) == ["attention_mask"]
    # fused layer: QKV, out, up, down; readout layer: Q, K, V, out, up, down (+ its 2 float activation
    # products, fused into one MultiHeadAttention); the head (pooler, classifier) float
    assert report["float_matmuls"] == 2 + 2 and report["int8_matmuls"] == 4 + 6


@pytest.mark.parametrize(("weight_format", "dtype", "low", "high"),
                         [("s7", np.int8, -64, 64), ("s8", np.int8, -127, 127), ("u8", np.uint8, 0, 255)])
def test_each_weight_format_stores_its_grid(built, tmp_path, weight_format, dtype, low, high):
    """s7: symmetric int8 within +-64 (`reduce_range`); s8: the full +-127; u8: uint8 with zero points, rows
    spread over 0..255. Every product's weight has the format's type."""
    from pipeline.variants.onnx_int8 import quantize_dynamic_onnx

    dst = tmp_path / "model.onnx"
    quantize_dynamic_onnx(built["dirs"]["fp32-onnx"] / "model.onnx", dst, per_channel=True,
                          weight_format=weight_format)
    weights = product_weights(dst)
    assert len(weights) >= 2 * 3 + 1 and {w.dtype for w in weights} == {np.dtype(dtype)}
    values = [w.astype(np.int32) for w in weights]
    assert min(int(w.min()) for w in values) >= low and max(int(w.max()) for w in values) <= high
    if weight_format == "u8":  # asymmetric per channel: the rows use both ends of the range
        assert min(int(w.min()) for w in values) == 0 and max(int(w.max()) for w in values) == 255
    else:  # symmetric per channel: every row's largest weight lands on the range's end
        assert max(int(np.abs(w).max()) for w in values) == high


def test_an_unknown_weight_format_is_refused(built, tmp_path):
    from pipeline.variants.onnx_int8 import QuantizeError, quantize_dynamic_onnx

    with pytest.raises(QuantizeError, match="unknown INT8 weight format 'u7'"):
        quantize_dynamic_onnx(built["dirs"]["fp32-onnx"] / "model.onnx", tmp_path / "m.onnx", weight_format="u7")
    with pytest.raises(ValueError, match=r"quantize\.weight_format: must be one of 's8', 's7', 'u8', 'auto'"):
        QuantizeParams(weight_format="int8")  # type: ignore[arg-type]


def test_weight_format_auto_follows_this_cpu_and_is_recorded(built):
    """`quantize.weight_format: auto` (default): signed 8-bit where the CPU has VNNI/AMX, else unsigned 8-bit;
    each variant records the format, the choice's reason and the CPU it was built on, and its file holds weights
    of that type only."""
    from pipeline.core.machine import cpu_flags, resolve_weight_format

    expected = resolve_weight_format("auto", cpu_flags()).value
    dtype = np.dtype(np.uint8 if expected == "u8" else np.int8)
    for name in ("int8-dynamic", "int8-static", "int8-qat"):
        report = built["quantize"][name]
        assert report["weight_format"] == expected
        assert report["weight_format_choice"].startswith(f"{expected} (asked auto: ")
        info = read_variant(built["dirs"][name])
        assert info.params["weight_format"] == expected
        assert set(info.built_on["isa"]) >= {"avx512_vnni", "avx_vnni", "amx_int8"}
        weights = product_weights(built["dirs"][name] / "model.onnx")
        assert weights and {w.dtype for w in weights} == {dtype}, name


def test_fp32_onnx_exported_with_another_readout_is_refused(built, tiny_model_dir, tmp_path):
    """Static QDQ starts from the fp32-onnx file: one exported under another `export.cls_readout` is stale."""
    from pipeline.core.params import ExportParams
    from pipeline.variants.onnx_int8 import QuantizeError

    with pytest.raises(QuantizeError, match="re-run the export stage"):
        run_quantize(finetuned=tiny_model_dir, fp32_onnx=built["dirs"]["fp32-onnx"], tokenized=built["tokenized"],
                     variants_root=tmp_path, params=Params(export=ExportParams(cls_readout=False)),
                     choice=weight_format_here(), qat_precision=qat_precision_here())
    assert not (tmp_path / "int8-dynamic").exists()


def test_openvino_int8_is_static_int8_in_openvino_ir_and_agrees_with_fp32(built, tokenizer):
    """int8-openvino: the exported graph (through torch.export) quantized by NNCF into OpenVINO IR whose weight
    products run in INT8 (FakeQuantize nodes, no float fallback), recorded with its build and served in batches (static
    scales); run through `load_runner`, its logits stay within INT8 rounding of fp32-onnx's on the test reviews."""
    import openvino as ov

    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.record import size_mb
    from pipeline.runtimes.registry import load_runner

    d = built["dirs"]["int8-openvino"]
    info = read_variant(d)
    assert info.status == "ok" and info.format == "openvino" and info.file == "model.xml"
    assert info.params["source"].startswith("torch.export") and info.params["calibration_samples"] == 32
    assert info.params["cls_readout"] is True  # the graph fp32-onnx holds: the last layer reads [CLS] only
    assert info.params["served_batching"] == "rows" and set(info.params["versions"]) == {"openvino", "nncf"}
    ops = [op.get_type_name() for op in ov.Core().read_model(str(d / "model.xml")).get_ops()]
    assert ops.count("FakeQuantize") >= 2 * 6, sorted(set(ops))  # Q, K, V, output, FFN up and down per layer
    # built after int8-dynamic, which leaves the model in eager attention: the first layer's attention still reaches
    # OpenVINO as its fused op (the [CLS]-readout last layer computes its own)
    assert ops.count("ScaledDotProductAttention") == 1, sorted(set(ops))
    assert size_mb(d, info) > (d / "model.xml").stat().st_size / 1e6  # the weights (.bin) are counted
    seqs = [np.asarray(s) for s in pd.read_parquet(built["tokenized"] / "test.parquet")["input_ids"]]
    runner = load_runner(d, threads=1)
    assert runner.describe()["runtime"] == "openvino" and runner.describe()["batching"] == "rows"
    got = predict_logits(runner, seqs, batch_size=8, pad_id=tokenizer.pad_token_id)
    ref = predict_logits(load_runner(built["dirs"]["fp32-onnx"], threads=1), seqs, batch_size=8,
                         pad_id=tokenizer.pad_token_id)
    # the tiny random model's logits differ by ~1e-4 between reviews: INT8 rounding is judged by its size, as for
    # the onnxruntime INT8 variants (about 1e-3 here)
    assert np.abs(got - ref).max() < 1e-2
