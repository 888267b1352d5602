"""Unit: `benchmarks.distill_tradeoff`: candidate configs, the reviews the held-out sample must avoid, the rule."""

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


def _row(params: int, seconds: float, delta: float, std_error: float) -> dict:
    return {"student_encoder_parameters": params, "wall_time_s": seconds,
            "int8-distilled": {"delta": delta, "delta_std_error": std_error}}


def test_rule_takes_the_smallest_student_inside_the_window_by_one_standard_error():
    from benchmarks.distill_tradeoff import choose

    rows = {
        "d3": _row(5_000_000, 400, -0.0053, 0.0020),  # point estimate outside
        "d3e3": _row(5_000_000, 500, -0.0044, 0.0020),  # inside on the point estimate, not by one s.e.
        "d4": _row(7_000_000, 480, +0.0029, 0.0018),
        "d5": _row(9_000_000, 520, +0.0040, 0.0018),
        "d4slow": _row(7_000_000, 900, +0.0029, 0.0018),
    }
    assert choose(rows, 0.5) == "d4"  # smallest inside; the same size with a longer distillation loses the tie
    assert choose(rows, 0.7) == "d3e3"  # a wider window lets the 3-layer candidate in
    assert choose({"d3": rows["d3"]}, 0.5) is None
