"""Unit: `benchmarks.distill_tradeoff`: candidate configs and the reviews the held-out sample must avoid."""

from __future__ import annotations

import pandas as pd
import pytest


def test_config_labels_and_overrides():
    from benchmarks.distill_tradeoff import parse_config

    assert parse_config("d4:distill.depth=4,distill.epochs=1") == ("d4", {"distill.depth": "4",
                                                                         "distill.epochs": "1"})
    assert parse_config("as-is:") == ("as-is", {})
    with pytest.raises(SystemExit):
        parse_config(":distill.depth=4")


def test_held_out_sample_avoids_every_candidates_transfer_reviews(tmp_path, monkeypatch):
    import benchmarks.distill_tradeoff as tradeoff

    root = tmp_path / "repo"
    (root / "data" / "prepared").mkdir(parents=True)
    pd.DataFrame({"text": ["a", "b"], "label": [0, 1]}).to_parquet(root / "data" / "prepared" / "train.parquet")
    pd.DataFrame({"text": ["c"]}).to_parquet(root / "data" / "prepared" / "transfer.parquet")
    bigger = tmp_path / "work" / "x16" / "prepared"
    bigger.mkdir(parents=True)
    pd.DataFrame({"text": ["c", "d", "e"]}).to_parquet(bigger / "transfer.parquet")
    monkeypatch.setattr(tradeoff, "ROOT", root)
    merged = tradeoff.excluded_reviews([tmp_path / "work" / "x16", tmp_path / "work" / "d3"], tmp_path / "work")
    assert sorted(pd.read_parquet(merged / "transfer.parquet")["text"]) == ["c", "d", "e"]
    assert sorted(pd.read_parquet(merged / "train.parquet")["text"]) == ["a", "b"]
