"""The transfer split prepare writes for distillation: unlabelled, disjoint from the labelled splits and drawn
without labels."""

from __future__ import annotations

import pandas as pd

from pipeline.core.params import DataParams
from tests.factories import synthetic_reviews


def test_transfer_split_is_unlabelled_disjoint_and_drawn_without_labels():
    from pipeline.data.imdb import TRANSFER, make_splits

    frame = synthetic_reviews(400)
    params = DataParams(train_count=300, val_count=50, train_subsample=100, seed=0, transfer_reviews=150)
    splits, report = make_splits(frame, params)
    transfer = splits[TRANSFER]
    assert list(transfer.columns) == ["text"] and len(transfer) == 150 and report.sizes[TRANSFER] == 150
    labelled = set().union(*(set(splits[s]["text"]) for s in ("train", "val", "test")))
    assert not set(transfer["text"]) & labelled
    full, _ = make_splits(frame, DataParams(train_count=300, val_count=50, seed=0))
    assert set(transfer["text"]) <= set(full["train"]["text"])  # from the train split's unused part only
    # asking for more than is left takes what is left; none asked, none written
    more, _ = make_splits(frame, DataParams(train_count=300, val_count=50, train_subsample=100, seed=0,
                                            transfer_reviews=10_000))
    assert len(more[TRANSFER]) == 200
    none, _ = make_splits(frame, DataParams(train_count=300, val_count=50, train_subsample=100, seed=0,
                                            transfer_reviews=0))
    assert TRANSFER not in none


def test_transfer_draw_never_reads_a_label(monkeypatch):
    """The draw is handed the unused train reviews without their label column; here a frame whose `label`
    access raises would fail it."""
    import pipeline.data.imdb as imdb

    seen: list[list[str]] = []
    original = imdb.draw_transfer_reviews

    def spy(unused: pd.DataFrame, params: DataParams):
        seen.append(list(unused.columns))
        return original(unused, params)

    monkeypatch.setattr(imdb, "draw_transfer_reviews", spy)
    imdb.make_splits(synthetic_reviews(400), DataParams(train_count=300, val_count=50, train_subsample=100,
                                                        seed=0, transfer_reviews=50))
    assert seen == [["text"]]
