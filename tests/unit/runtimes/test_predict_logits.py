"""Unit: `predict_logits` stops at a runner's first failure: queued batches are not scored after it (with one caller
or many), the error reaches the caller, and the progress bar is closed either way; `length_sorted_batches`, the
calibration passes' batching."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest

from pipeline.runtimes.base import predict_logits


class FailsFirst:
    """A runner whose first call raises; each later call takes a while (a real batch's scoring), so batches still
    queued when the failure is seen are only scored if nothing cancels them."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            raise RuntimeError("cannot score this batch")
        time.sleep(0.2)
        return np.zeros((len(input_ids), 2), dtype=np.float32)


class Bar:
    """A stand-in for tqdm that records whether it was closed."""

    made: ClassVar[list[Bar]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.closed = False
        Bar.made.append(self)

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("callers", [1, 2, 4])
def test_the_first_failure_stops_the_scoring_and_closes_the_bar(monkeypatch, callers):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    Bar.made.clear()
    runner = FailsFirst()
    seqs = [np.arange(1, 5 + i % 7) for i in range(200)]  # 100 batches of 2
    with pytest.raises(RuntimeError, match="cannot score this batch"):
        predict_logits(runner, seqs, batch_size=2, progress="score", callers=callers)
    # the failing call and those already under way on the other threads, not the 99 batches queued behind them: no
    # batch starts once a call has failed, however late the calling thread sees the failure
    assert runner.calls <= callers
    assert len(Bar.made) == 1 and Bar.made[0].closed


def test_every_batch_is_scored_once_when_none_fails():
    calls = []

    def runner(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        calls.append(len(input_ids))
        return np.stack([input_ids.sum(1), attention_mask.sum(1)], axis=1).astype(np.float32)

    seqs = [np.arange(1, 2 + i % 5) for i in range(23)]
    logits = predict_logits(runner, seqs, batch_size=4, callers=3)
    assert sum(calls) == 23 and len(calls) == 6
    np.testing.assert_array_equal(logits[:, 1], [len(s) for s in seqs])  # each row in its original place
    np.testing.assert_array_equal(logits[:, 0], [s.sum() for s in seqs])


def test_length_sorted_batches_pad_each_batch_to_its_own_longest_and_keep_ties_in_order():
    """The calibration passes' batches: every review once, shortest first (ties in their given order), each batch
    padded only to its own longest review, the mask marking the real tokens."""
    from pipeline.runtimes.base import length_sorted_batches

    seqs = [np.full(n, i + 10) for i, n in enumerate([5, 2, 7, 2, 3])]
    batches = length_sorted_batches(seqs, batch_size=2, pad_id=0)
    assert [ids.shape for ids, _ in batches] == [(2, 2), (2, 5), (1, 7)]
    assert [int(ids[j, 0]) for ids, _ in batches for j in range(len(ids))] == [11, 13, 14, 10, 12]  # 2, 2, 3, 5, 7
    ids, mask = batches[1]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]] and ids[0, 3:].tolist() == [0, 0]
