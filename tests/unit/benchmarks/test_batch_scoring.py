"""Unit: the batch-scoring benchmark's comparison of Spark's answers with in-process ones (the runs themselves need
a registered model and minutes: `python -m benchmarks.batch_scoring`)."""

from __future__ import annotations

import pandas as pd

from benchmarks.batch_scoring import agreement, table


def test_answers_are_compared_review_by_review_whatever_order_spark_wrote_them_in():
    ids = pd.Series([0, 1, 2])
    local = pd.DataFrame({"label": ["positive", "negative", "positive"], "score": [0.9, 0.8, 0.7]})
    spark = pd.DataFrame({"review_id": [2, 0, 1], "label": ["positive", "positive", "negative"],
                          "score": [0.70001, 0.9, 0.8], "error": [None, None, None]})
    same = agreement(spark, ids, local)
    assert same["within_1e-4"] and same["same_label"] == 3 and same["errors"] == 0
    spark.loc[0, "score"] = 0.7002  # review 2 drifts past 1e-4
    assert not agreement(spark, ids, local)["within_1e-4"]
    spark.loc[0, ["label", "score"]] = ["negative", 0.7]  # review 2 flips
    flipped = agreement(spark, ids, local)
    assert not flipped["within_1e-4"] and flipped["same_label"] == 2


def test_the_table_gives_each_path_its_rate_against_in_process():
    spark = {"partitions": 2, "rows_in": 1000, "seconds": 10.0, "rows_per_s": 100.0, "command_s": 20.0}
    local = {"chunk": 2048, "rows": 1000, "seconds": 8.0, "rows_per_s": 125.0}
    rows = table(spark, local, 2).splitlines()
    assert rows[2].endswith("| 125.0 | 1.00 |") and rows[3].endswith("| 100.0 | 0.80 |")
    assert rows[4].endswith("| 50.0 | 0.40 |")
