"""Unit: static INT8 calibrates on real tokens only. The reader's batches hold no padding (one length each, every
review once), and a calibrator fed the reader batch by batch observes exactly the activations of each review
scored alone: the ranges of a mix of short and long reviews are the union of each review's own ranges."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.variants.calibration import TokenCalibrationReader, collect_by_batch, unpadded_batches


@given(st.lists(st.integers(1, 12), max_size=40), st.integers(1, 6))
def test_batches_hold_one_length_each_and_every_review_once(lengths, batch_size):
    seqs = [np.arange(i, i + n) for i, n in enumerate(lengths)]
    batches = unpadded_batches(seqs, batch_size)
    assert all(1 <= len(b) <= batch_size and len({len(s) for s in b}) == 1 for b in batches)
    assert Counter(tuple(s) for b in batches for s in b) == Counter(tuple(s) for s in seqs)
    firsts = [len(b[0]) for b in batches]
    assert firsts == sorted(firsts)  # shortest first


def test_the_reader_feeds_unmasked_batches_and_slices_as_quantize_static_asks():
    seqs = [np.arange(1, 1 + n) for n in (3, 5, 5, 5, 8)]
    reader = TokenCalibrationReader(seqs, 2, {"input_ids", "attention_mask"})
    assert len(reader) == 4  # [3], [5, 5], [5], [8]
    fed = iter(reader.get_next, None)
    shapes = [(f["input_ids"].shape, int(f["attention_mask"].min())) for f in fed]
    assert shapes == [((1, 3), 1), ((2, 5), 1), ((1, 5), 1), ((1, 8), 1)]
    reader.set_range(1, 2)
    assert reader.get_next()["input_ids"].shape == (2, 5) and reader.get_next() is None
    reader.rewind()
    assert sum(1 for _ in iter(reader.get_next, None)) == 4
    assert set(TokenCalibrationReader(seqs, 2, {"input_ids"}).get_next()) == {"input_ids"}


def ranges(model_path, seqs, tmp_path, tag: str) -> dict[str, tuple[float, float]]:
    """The min/max onnxruntime's calibrator observes at every MatMul input of `model_path` for `seqs`."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    calibrator = create_calibrator(model_path, ["MatMul"], augmented_model_path=str(tmp_path / f"{tag}.onnx"),
                                   calibrate_method=CalibrationMethod.MinMax)
    collect_by_batch(calibrator, TokenCalibrationReader(seqs, 4, {"input_ids", "attention_mask"}))
    data = calibrator.compute_data()
    return {name: (float(np.min(r.range_value[0])), float(np.max(r.range_value[1]))) for name, r in data.items()}


def test_a_calibrator_sees_each_review_as_scored_alone_and_no_padding(built, tmp_path):
    src = built["dirs"]["fp32-onnx"] / "model.onnx"
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1000, 2000, n) for n in (4, 7, 7, 19, 30)]  # lengths a padded batch would pad to 30
    mixed = ranges(src, seqs, tmp_path, "mixed")
    alone = [ranges(src, [s], tmp_path, f"alone{i}") for i, s in enumerate(seqs)]
    assert mixed.keys() == alone[0].keys() and mixed
    for name, (low, high) in mixed.items():
        assert np.isclose(low, min(a[name][0] for a in alone), rtol=0, atol=1e-5), name
        assert np.isclose(high, max(a[name][1] for a in alone), rtol=0, atol=1e-5), name
