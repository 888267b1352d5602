"""Unit: an OpenVINO INT8 build records the float precision the CPU plugin compiles it to on the build CPU (its own
choice: bf16 where the CPU has native bf16, else f32), which the variant's MLflow run and model carry as params."""

from __future__ import annotations

import pytest

from pipeline.runtimes.openvino import OpenVinoRunner
from pipeline.runtimes.record import read_variant


@pytest.mark.parametrize("name", ["int8-openvino", "int8-qat-openvino"])
def test_the_build_records_the_inference_precision_the_runner_compiles_with(built, name):
    """Both OpenVINO builds of the tiny model (`built`: the quantize stage's own code, on this machine)."""
    directory = built["dirs"][name]
    recorded = read_variant(directory).params["inference_precision_on_build_cpu"]
    assert recorded == built["quantize"][name]["inference_precision_on_build_cpu"]
    described = OpenVinoRunner(directory / "model.xml").describe()
    assert recorded == described["inference_precision"]
    assert described["inference_precision"] in ("f32", "bf16", "f16")
