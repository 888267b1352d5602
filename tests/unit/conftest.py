"""Fixtures of the unit tier: every variant built once from the tiny BERT (the variants, evaluation and
deployment unit tests read it; none of them writes into it)."""

from __future__ import annotations

import pytest

from pipeline.core.params import ExportParams, Params, QuantizeParams, TensorRTParams, TrainParams
from pipeline.runtimes.catalog import directories
from pipeline.variants.export import run_export
from pipeline.variants.quantize import run_quantize
from pipeline.variants.tensorrt import run_tensorrt
from tests.factories import weight_format_here, write_tokenized

NAMES = ["fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat", "int8-openvino", "tensorrt-fp16",
         "tensorrt-int8"]


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_model_dir):
    """All variants of the tiny model, plus tokenized synthetic data to score them on."""
    root = tmp_path_factory.mktemp("variants")
    tok_dir = write_tokenized(root / "tokenized", {"train": 64, "val": 32, "test": 48})
    variants_root = root / "variants"
    dirs = {n: d for n, d in directories(variants_root).items() if n in NAMES}
    export_report = run_export(finetuned=tiny_model_dir, tokenized=tok_dir, variants_root=variants_root,
                               params=ExportParams(parity_samples=8, torchscript=True))
    q = QuantizeParams(calibration_samples=32, selection_samples=32, qat_train_samples=32, qat_batch_size=8,
                       calibration_methods=["minmax", "entropy"],
                       build=["int8-dynamic", "int8-static", "int8-qat", "int8-openvino"])
    quant_report = run_quantize(finetuned=tiny_model_dir, fp32_onnx=dirs["fp32-onnx"], tokenized=tok_dir,
                                variants_root=variants_root, choice=weight_format_here(),
                                params=Params(quantize=q,
                                              train=TrainParams(checkpoint_dir=str(variants_root / "ckpt"))))
    trt_report = run_tensorrt(finetuned=tiny_model_dir, fp32_onnx=dirs["fp32-onnx"], int8_static=dirs["int8-static"],
                              tokenized=tok_dir, variants_root=variants_root,
                              params=Params(quantize=q, tensorrt=TensorRTParams(qdq_input=True)))
    return {"dirs": dirs, "root": variants_root, "tokenized": tok_dir, "export": export_report,
            "quantize": quant_report, "trt": trt_report}
