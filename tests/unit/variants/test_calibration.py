"""Unit: the static calibration's data reader feeds length-sorted batches in one order wherever it runs."""

from __future__ import annotations

import numpy as np

from pipeline.runtimes.base import length_sorted_batches
from pipeline.variants.calibration import TokenCalibrationReader


def test_calibration_batches_keep_reviews_of_one_length_in_their_given_order():
    """Many reviews share a length: ties keep their order (a stable sort), so the batches, and the ranges calibrated
    on them, do not depend on the numpy version or the CPU's sort kernel; the order is the one every length-sorted
    pass uses (`length_sorted_batches`)."""
    seqs = [np.full(8 + 4 * (i % 3), 1000 + i) for i in range(200)]  # three lengths, each review its own token
    reader = TokenCalibrationReader(seqs, 16, {"input_ids", "attention_mask"})
    firsts = [int(s[0]) for batch in reader.batches for s in batch]
    expected = [1000 + i for length in (8, 12, 16) for i in range(200) if 8 + 4 * (i % 3) == length]
    assert firsts == expected
    shared = [int(ids[row, 0]) for ids, _ in length_sorted_batches(seqs, batch_size=16, pad_id=0)
              for row in range(len(ids))]
    assert shared == expected
    feed = reader.get_next()
    assert feed is not None and feed["input_ids"].shape == (16, 16)  # every batch padded to the longest review
