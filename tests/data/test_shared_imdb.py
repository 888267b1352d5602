"""Data tier: the shared IMDB copy and the reference split built from it."""

from __future__ import annotations

import pandas as pd
import pytest

from pipeline.core.params import DataParams
from pipeline.data.imdb import LABELS, load_imdb, make_splits, text_digest


@pytest.fixture(scope="module")
def frame(imdb_dir) -> pd.DataFrame:
    return load_imdb(DataParams(source="parquet", local_dir=str(imdb_dir)))


@pytest.fixture(scope="module")
def reference(frame):
    return make_splits(frame, DataParams(seed=42, train_subsample=None, val_subsample=None, test_subsample=None))


def test_schema(imdb_dir):
    for name in ("train", "test"):
        df = pd.read_parquet(imdb_dir / f"{name}.parquet")
        assert {"text", "label"} <= set(df.columns)
        assert df["text"].map(type).eq(str).all()
        assert set(df["label"].unique()) == set(LABELS)


def test_source_size_and_balance(frame):
    assert len(frame) == 45_000
    assert frame["label"].mean() == pytest.approx(0.5, abs=0.01)


def test_reference_split_sizes(reference):
    _splits, report = reference
    assert report.sizes["train"] == 35_000 and report.sizes["val"] == 5_000
    assert report.sizes["test"] == 45_000 - 35_000 - 5_000 - report.duplicates_dropped - report.conflicting_dropped
    assert report.duplicates_dropped > 0  # IMDB has a few hundred exact duplicate reviews


def test_no_leakage_between_splits(reference):
    splits, _ = reference
    digests = {name: set(map(text_digest, df["text"])) for name, df in splits.items()}
    assert not digests["train"] & digests["val"]
    assert not digests["train"] & digests["test"]
    assert not digests["val"] & digests["test"]


def test_splits_are_balanced_and_clean(reference):
    splits, _ = reference
    for df in splits.values():
        assert df["label"].mean() == pytest.approx(0.5, abs=0.02)
        assert not df["text"].str.contains("<br", case=False).any()
        assert df["text"].str.strip().str.len().gt(0).all()


@pytest.fixture(scope="module")
def default_run(frame):
    """The splits the default profile trains, validates, tests and distills on (params.yaml's `data`, subsamples
    and transfer reviews included), cut from the same shared copy."""
    from pipeline.core.params import load_params
    from tests.factories import ROOT

    data = load_params(ROOT / "params.yaml").data
    return data, make_splits(frame, data)


def test_the_default_runs_splits_share_no_review_and_the_transfer_split_has_no_label(default_run):
    data, (splits, _report) = default_run
    assert {"train", "val", "test", "transfer"} <= set(splits)
    sizes = {name: len(df) for name, df in splits.items()}
    assert (sizes["train"], sizes["val"], sizes["test"], sizes["transfer"]) == \
        (data.train_subsample, data.val_subsample, data.test_subsample, data.transfer_reviews)
    digests = {name: set(map(text_digest, df["text"])) for name, df in splits.items()}
    names = sorted(digests)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not digests[a] & digests[b], (a, b)
    assert "label" not in splits["transfer"].columns
    for name in ("train", "val", "test"):
        assert splits[name]["label"].mean() == pytest.approx(0.5, abs=0.03), name
