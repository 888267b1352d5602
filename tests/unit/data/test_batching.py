"""Unit: length-bucketed batch sampler and dynamic-padding collator."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.batching import Collator, LengthBucketBatchSampler


def test_collator_pads_to_multiple_and_masks():
    batch = [(np.array([101, 5, 6, 102]), 1), (np.array([101, 7, 102]), 0)]
    out = Collator(pad_id=0, multiple_of=8)(batch)
    assert out["input_ids"].shape == (2, 8)
    assert out["attention_mask"].sum(1).tolist() == [4, 3]
    assert out["input_ids"][1, 3:].eq(0).all()
    assert out["labels"].tolist() == [1, 0]


def test_collator_never_cuts_below_longest():
    batch = [(np.arange(1, 11), 0)]
    out = Collator(multiple_of=8, max_length=10)(batch)
    assert out["input_ids"].shape[1] == 10


def test_every_index_once_and_batches_are_length_homogeneous():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 512, size=1000)
    sampler = LengthBucketBatchSampler(lengths, batch_size=16, pool_batches=20, seed=3)
    batches = list(sampler)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000))
    assert len(batches) == len(sampler) == 63
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    random_spread = np.mean([np.ptp(lengths[rng.permutation(1000)[:16]]) for _ in range(50)])
    assert spread < random_spread / 4  # bucketing really groups similar lengths


def test_batch_order_is_shuffled_and_epoch_dependent():
    lengths = np.arange(320)
    sampler = LengthBucketBatchSampler(lengths, batch_size=8, pool_batches=40, seed=0)
    first = [b[0] for b in sampler]
    assert first != sorted(first)  # not a length curriculum
    sampler.set_epoch(1)
    assert [b[0] for b in sampler] != first
    sampler.set_epoch(0)
    assert [b[0] for b in sampler] == first  # reproducible


def test_ddp_shards_are_disjoint_and_equal():
    lengths = np.random.default_rng(1).integers(5, 100, size=203)
    shards = [list(LengthBucketBatchSampler(lengths, 8, seed=4, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1])
    a = {i for b in shards[0] for i in b}
    b = {i for b in shards[1] for i in b}
    assert not a & b
    # together the two ranks cover the single-process epoch, short of at most one batch per rank (the equal split)
    whole = list(LengthBucketBatchSampler(lengths, 8, seed=4))
    assert len(shards[0]) == len(whole) // 2
    assert len(a | b) >= len(lengths) - 2 * 8


def test_bad_rank_rejected():
    with pytest.raises(ValueError, match="rank"):
        LengthBucketBatchSampler([1, 2], 1, num_replicas=2, rank=2)
