"""Unit: the TensorRT runner's checks of TensorRT's answers, on fake engines and contexts (no GPU, no `tensorrt`):
a shape outside the optimisation profile, an output of another shape and a refused launch are errors naming the
shapes and the profile's bounds, never logits read from an unwritten buffer; an engine TensorRT cannot
deserialise is refused at load with what it was built with and what this machine has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.runtimes.record import VariantError, VariantInfo
from pipeline.runtimes.tensorrt import (
    TensorRTRunner,
    deserialized_engine,
    gpu_record,
    launch,
    profile_bounds,
)

#: The fake engine's profile: batch 1..8, sequence 8..64, as `tensorrt.profile_shapes` builds one.
PROFILE = {"input_ids": ((1, 8), (4, 32), (8, 64)), "attention_mask": ((1, 8), (4, 32), (8, 64))}


class FakeEngine:
    """An `ICudaEngine`'s profile query."""

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, int]]:
        assert profile == 0
        return list(PROFILE[name])


class FakeContext:
    """An execution context as TensorRT 10 answers: False for a shape outside the profile or a refused launch, the
    output shape following the batch; it records every call."""

    def __init__(self, launches: bool = True, classes: int = 2) -> None:
        self.launches = launches
        self.classes = classes
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.executed: list[int] = []

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = PROFILE[name]
        if not all(lo <= d <= hi for lo, d, hi in zip(low, shape, high, strict=True)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        assert name == "logits"
        return (self.shapes["input_ids"][0], self.classes)

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.executed.append(stream_handle)
        return self.launches


def inputs(batch: int, length: int) -> dict[str, tuple[tuple[int, int], int]]:
    return {"input_ids": ((batch, length), 1000), "attention_mask": ((batch, length), 2000)}


def test_a_batch_within_the_profile_is_bound_and_launched():
    context = FakeContext()
    launch(context, FakeEngine(), stream_handle=7, inputs=inputs(3, 40), output_address=3000, batch=3)
    assert context.shapes == {"input_ids": (3, 40), "attention_mask": (3, 40)}
    assert context.addresses == {"input_ids": 1000, "attention_mask": 2000, "logits": 3000}
    assert context.executed == [7]


@pytest.mark.parametrize(("batch", "length"), [(9, 32), (4, 4), (4, 65)])
def test_a_shape_outside_the_profile_is_an_error_naming_it_and_the_bounds(batch, length):
    context = FakeContext()
    with pytest.raises(VariantError, match=rf"input_ids of shape \({batch}, {length}\).*\(1, 8\) to \(8, 64\)"):
        launch(context, FakeEngine(), stream_handle=7, inputs=inputs(batch, length), output_address=3000,
               batch=batch)
    assert context.executed == []  # never launched: the output buffer would hold no logits
    assert "logits" not in context.addresses


def test_a_refused_launch_is_an_error_naming_the_shapes():
    with pytest.raises(VariantError, match=r"could not launch.*'input_ids': \(2, 16\)"):
        launch(FakeContext(launches=False), FakeEngine(), stream_handle=7, inputs=inputs(2, 16),
               output_address=3000, batch=2)


def test_an_output_of_another_shape_than_the_buffer_is_an_error_before_the_launch():
    context = FakeContext(classes=3)
    with pytest.raises(VariantError, match=r"logits .* has shape \(2, 3\), not \(2, 2\)"):
        launch(context, FakeEngine(), stream_handle=7, inputs=inputs(2, 16), output_address=3000, batch=2)
    assert context.executed == []


def test_profile_bounds_are_the_profiles_min_and_max():
    assert profile_bounds(FakeEngine()) == {"input_ids": ((1, 8), (8, 64)), "attention_mask": ((1, 8), (8, 64))}


class FakeRuntime:
    """A `tensorrt.Runtime` that deserialises to `engine` (None: an engine from another TensorRT or GPU)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.read: list[bytes] = []

    def deserialize_cuda_engine(self, data: bytes) -> Any:
        self.read.append(data)
        return self.engine


def test_an_engine_tensorrt_cannot_deserialise_is_refused_with_its_build_and_this_machine():
    built = {"tensorrt_version": "10.3.0", "gpu": "NVIDIA A10G", "compute_capability": "8.6"}
    here = {"tensorrt_version": "10.7.0", "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    refused = (r"model\.engine: built with tensorrt_version 10\.3\.0, gpu NVIDIA A10G, compute_capability 8\.6; "
               r"this machine has tensorrt_version 10\.7\.0.*9\.0")
    with pytest.raises(VariantError, match=refused):
        deserialized_engine(FakeRuntime(None), b"engine", Path("v/model.engine"), built, here)
    with pytest.raises(VariantError, match="gpu unrecorded"):  # an engine recorded before the GPU was
        deserialized_engine(FakeRuntime(None), b"engine", Path("model.engine"), {"tensorrt_version": "10.3.0"}, here)
    engine = FakeEngine()
    runtime = FakeRuntime(engine)
    assert deserialized_engine(runtime, b"engine", Path("model.engine"), built, here) is engine
    assert runtime.read == [b"engine"]


def test_gpu_record_names_the_device_and_its_compute_capability(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert gpu_record() == {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}


def test_load_refuses_any_option_before_touching_tensorrt(tmp_path):
    info = VariantInfo("tensorrt-fp16", "tensorrt", "float16", "model.engine")
    with pytest.raises(VariantError, match=r"tensorrt runtime has no option 'batching'; its options: none"):
        TensorRTRunner.load(tmp_path, info, batching="rows")
