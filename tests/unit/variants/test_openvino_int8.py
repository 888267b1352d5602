"""Unit: an OpenVINO INT8 build records the float precision the CPU plugin compiles it to on the build CPU (its own
choice: bf16 where the CPU has native bf16, else f32), which the variant's MLflow run and model carry as params."""

from __future__ import annotations

import numpy as np

from pipeline.modeling import load_finetuned
from pipeline.runtimes.openvino import OpenVinoRunner
from pipeline.variants.openvino_int8 import quantize_openvino


def test_the_build_records_the_inference_precision_the_runner_compiles_with(tmp_path, tiny_model_dir):
    model, _, _ = load_finetuned(tiny_model_dir)
    rng = np.random.default_rng(0)
    calibration = [rng.integers(1000, 2000, size=int(n)) for n in rng.integers(8, 33, size=8)]
    record = quantize_openvino(model.eval(), calibration, 0, 4, tmp_path)
    described = OpenVinoRunner(tmp_path / "model.xml").describe()
    assert record["inference_precision_on_build_cpu"] == described["inference_precision"]
    assert described["inference_precision"] in ("f32", "bf16", "f16")
