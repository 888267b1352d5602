"""Unit: loading, cleaning, splitting and integrity checks on small synthetic data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.core.params import DataParams
from pipeline.data.imdb import DataSourceError, DataValidationError, clean_text, load_imdb, make_splits, validate_splits
from pipeline.data.tokens import truncate_ids
from tests.conftest import synthetic_reviews


def test_clean_text_strips_br_and_spaces():
    assert clean_text("Great<br /><br />film.<BR>Truly  great ") == "Great film. Truly great"


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("head", [101, 0, 1, 2, 3, 4, 5, 102]), ("head_tail", [101, 0, 15, 16, 17, 18, 19, 102])],
)
def test_truncation_modes(mode, expected):
    ids = list(range(20))
    out = truncate_ids(ids, 8, mode, 0.25, 101, 102)
    assert len(out) == 8
    assert out == expected


def test_short_reviews_are_not_truncated():
    assert truncate_ids([1, 2], 8, "head_tail", 0.25, 101, 102) == [101, 1, 2, 102]


def _params(**kw) -> DataParams:
    return DataParams(**{"train_count": 60, "val_count": 20, "seed": 0, **kw})


def test_split_sizes_dedup_and_conflicts():
    df = synthetic_reviews(100)
    df = pd.concat([df, df.iloc[:5]], ignore_index=True)  # 5 exact duplicates
    df.loc[len(df)] = [df.text[10], 1 - df.label[10]]  # one review with both labels
    splits, report = make_splits(df, _params())
    assert report.duplicates_dropped == 5
    assert report.conflicting_dropped == 2
    assert report.sizes == {"train": 60, "val": 20, "test": 19}
    validate_splits(splits)


def test_subsample_keeps_class_balance():
    splits, report = make_splits(synthetic_reviews(400), _params(train_count=300, val_count=50, train_subsample=100))
    assert report.sizes["train"] == 100
    assert splits["train"]["label"].mean() == pytest.approx(0.5, abs=0.02)


def test_split_is_seeded():
    a, _ = make_splits(synthetic_reviews(100), _params())
    b, _ = make_splits(synthetic_reviews(100), _params())
    c, _ = make_splits(synthetic_reviews(100), _params(seed=1))
    assert a["train"]["text"].tolist() == b["train"]["text"].tolist()
    assert a["train"]["text"].tolist() != c["train"]["text"].tolist()


def test_too_few_reviews_is_a_clear_error():
    with pytest.raises(DataValidationError, match="unique labelled reviews"):
        make_splits(synthetic_reviews(50), _params())


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ({"train": pd.DataFrame({"text": ["a", "b"], "label": [0, 1]}),
          "test": pd.DataFrame({"text": ["b"], "label": [1]})}, "leakage"),
        ({"train": pd.DataFrame({"text": ["a", "b"], "label": [0, 2]})}, "labels must be 0/1"),
        ({"train": pd.DataFrame({"text": ["a", "  "], "label": [0, 1]})}, "empty review"),
        ({"train": pd.DataFrame({"review": ["a"], "label": [0]})}, "missing column"),
    ],
)
def test_validation_rules(frames, needle):
    with pytest.raises(DataValidationError, match=needle):
        validate_splits(frames)


def test_missing_parquet_source_says_what_to_set(tmp_path):
    with pytest.raises(DataSourceError) as err:
        load_imdb(DataParams(source="parquet", local_dir=str(tmp_path)))
    assert "data.local_dir" in str(err.value) and "IMDB_DIR" in str(err.value)


def test_aclimdb_layout(tmp_path):
    root = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for sub in ("pos", "neg"):
            (root / split / sub).mkdir(parents=True)
            for i in range(3):
                (root / split / sub / f"{i}_7.txt").write_text(f"{split} {sub} review {i}<br />end")
    df = load_imdb(DataParams(source="aclimdb", local_dir=str(tmp_path)))
    assert len(df) == 12
    assert df.groupby("label").size().tolist() == [6, 6]
    assert set(df[df.text.str.contains(" pos ")].label) == {1}


def test_aclimdb_missing_folder(tmp_path):
    with pytest.raises(DataSourceError, match="aclImdb folder"):
        load_imdb(DataParams(source="aclimdb", local_dir=str(tmp_path)))


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


@pytest.mark.parametrize("mode", ["head", "head_tail"])
def test_retruncating_a_tokenized_review_equals_truncating_the_original(mode):
    """`train.max_length` shortens tokenized reviews; the window must be what tokenizing short would give."""
    import numpy as np

    from pipeline.data.tokens import retruncate

    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = list(rng.integers(1000, 2000, int(rng.integers(1, 700))))
        long_len = int(rng.integers(16, 513))
        short_len = int(rng.integers(8, long_len + 1))
        stored = truncate_ids(ids, long_len, mode, 0.25, 101, 102)
        assert retruncate(stored, short_len, mode, 0.25, 101, 102).tolist() == truncate_ids(
            ids, short_len, mode, 0.25, 101, 102)
    with pytest.raises(ValueError, match="CLS"):
        retruncate(list(range(20)), 8, mode, 0.25, 101, 102)


def test_paired_difference_counts_only_disagreements():
    from benchmarks.heldout_accuracy import paired_difference

    labels = np.array([1, 1, 0, 0, 1, 0, 1, 0])
    ref = np.array([1, 1, 0, 0, 1, 0, 0, 1])      # 6/8 right
    pred = np.array([1, 1, 0, 0, 0, 0, 1, 1])     # 6/8 right: one gained, one lost
    r = paired_difference(pred, ref, labels)
    assert r["accuracy"] == 0.75 and r["delta"] == 0.0 and r["agreement"] == 0.75
    assert r["delta_std_error"] == pytest.approx(np.std([0, 0, 0, 0, -1, 0, 1, 0], ddof=1) / np.sqrt(8))
    worse = paired_difference(np.array([0, 1, 0, 0, 1, 0, 0, 1]), ref, labels)
    assert worse["delta"] == -0.125
