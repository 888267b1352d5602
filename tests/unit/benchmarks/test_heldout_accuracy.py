"""Unit: `benchmarks.heldout_accuracy`: which reviews it may score, and the paired difference it reports."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import DataParams
from pipeline.data.imdb import load_imdb, make_splits
from tests.factories import synthetic_reviews


def _params(**kw) -> DataParams:
    return DataParams(**{"train_count": 60, "val_count": 20, "seed": 0, **kw})


def test_heldout_benchmark_scores_only_train_reviews_never_trained_on(tmp_path):
    """benchmarks.heldout_accuracy must not score a review the profile trained on, validated or tested on."""
    from benchmarks.heldout_accuracy import unseen_train_reviews

    df = synthetic_reviews(400)
    df.iloc[:300].to_parquet(tmp_path / "train.parquet")
    df.iloc[300:].to_parquet(tmp_path / "test.parquet")
    params = _params(source="parquet", local_dir=str(tmp_path), train_count=300, val_count=50, train_subsample=100,
                     val_subsample=20, test_subsample=20)
    splits, _ = make_splits(load_imdb(params), params)
    full, _ = make_splits(load_imdb(params), _params(train_count=300, val_count=50))
    unseen = unseen_train_reviews(params, tmp_path, splits["train"], 80, seed=0)
    assert len(unseen) == 80 and unseen["label"].mean() == pytest.approx(0.5, abs=0.02)
    assert set(unseen.text) <= set(full["train"].text)
    assert not set(unseen.text) & (set(splits["train"].text) | set(full["val"].text) | set(full["test"].text))


def test_paired_difference_counts_only_disagreements():
    from benchmarks.heldout_accuracy import paired_difference

    labels = np.array([1, 1, 0, 0, 1, 0, 1, 0])
    ref = np.array([1, 1, 0, 0, 1, 0, 0, 1])      # 6/8 right
    pred = np.array([1, 1, 0, 0, 0, 0, 1, 1])     # 6/8 right: one gained, one lost
    r = paired_difference(pred, ref, labels)
    assert r["accuracy"] == 0.75 and r["delta"] == 0.0 and r["agreement"] == 0.75
    # evaluate's Agresti-Min paired error: one review each way, plus half a review in each of the four cells
    b = c = 1 + 0.5
    assert r["delta_std_error"] == pytest.approx(np.sqrt(b + c - (c - b) ** 2 / 10) / 10, abs=1e-6)
    same = paired_difference(ref, ref, labels)     # no disagreement is not certainty
    assert same["delta"] == 0.0 and same["delta_std_error"] > 0
    worse = paired_difference(np.array([0, 1, 0, 0, 1, 0, 0, 1]), ref, labels)
    assert worse["delta"] == -0.125
