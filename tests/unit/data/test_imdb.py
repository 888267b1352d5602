"""Unit: loading, cleaning, splitting and integrity checks on small synthetic data."""

from __future__ import annotations

import pandas as pd
import pytest

from pipeline.core.params import DataParams
from pipeline.data.cleaning import clean_text
from pipeline.data.imdb import DataSourceError, DataValidationError, load_imdb, make_splits, validate_splits
from tests.factories import synthetic_reviews


def test_clean_text_strips_br_and_spaces():
    assert clean_text("Great<br /><br />film.<BR>Truly  great ") == "Great film. Truly great"


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
