"""Unit: the serving-process start-up benchmark on one variant of the tiny model (its timings are not asserted)."""

from __future__ import annotations

import json

from benchmarks import predictor_startup


def test_a_fresh_process_per_variant_is_timed_and_says_what_it_imported(built, tmp_path):
    root = tmp_path / "variants"
    root.mkdir()
    (root / "int8-dynamic").symlink_to(built["dirs"]["int8-dynamic"], target_is_directory=True)
    out = tmp_path / "startup.json"
    predictor_startup.main(["--variants-root", str(root), "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["variant"] == "int8-dynamic" and row["repeats"] == 1
    assert row["first_answer_s"] > 0 and row["cpu_s"] > 0 and row["peak_rss_mb"] > 20
    assert row["imports_torch"] is False and row["imports_transformers"] is False
    assert result["machine"]["cpu"] and "isa" in result["machine"]  # every timing says on which CPU
