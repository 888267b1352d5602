"""Unit: TensorRT variants: optimisation profiles and the skip record where no CUDA device is visible."""

from __future__ import annotations

import pytest

from pipeline.variants.record import VariantError, read_variant
from pipeline.variants.runners import load_runner
from pipeline.variants.tensorrt import availability, profile_shapes


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
