"""How batch scoring (`pipeline.deployment.batch_scoring`) lays its work out on Spark: the rows dealt into
partitions of a bounded size for the tasks that run at once (`default_partitions`), and the answers' frame, where
the rows the contract refuses are split off before the model's UDF and joined back after (`scored_frame`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pipeline.deployment.batch_rows import checked_text
from pipeline.deployment.protocol import TEXT_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: What the id, the text and the model's answer are called inside the job (the input's own names may hold dots).
ID, TEXT, ANSWER = "_scoring_id", "_scoring_text", "_scoring_answer"
#: The most rows of one partition unless `--partitions` says otherwise: one task's work stays short (minutes on one
#: core), so progress advances in small steps and a slow or retried task delays the end by little.
PARTITION_ROWS = 10_000


def default_partitions(rows: int, slots: int) -> int:
    """How many partitions `rows` rows are dealt into for `slots` tasks running at once: a multiple of `slots`
    (each wave of tasks keeps every slot busy) with at most `PARTITION_ROWS` rows each, one wave at least."""
    slots = max(1, slots)
    return slots * max(1, math.ceil(rows / (slots * PARTITION_ROWS)))


def task_slots(spark: SparkSession) -> int:
    """Tasks Spark runs at once: its default parallelism (the cores of `local[n]`, or the executors' cores) over
    the cores each task takes (`spark.task.cpus`, `--task-threads`)."""
    per_task = int(spark.sparkContext.getConf().get("spark.task.cpus", "1"))
    return max(1, spark.sparkContext.defaultParallelism // max(1, per_task))



def scored_frame(frame: DataFrame, model_udf: Any, max_chars: int, text_column: str) -> DataFrame:
    """`ID`, `label`, `score`, `error` for every row of `frame` (columns `ID` and `TEXT`, and `MALFORMED_ROW` for a
    CSV input; `text_column` is the input's name for the texts, which the errors name): rows the contract refuses
    carry the error and no label or score, and never reach the model (they are filtered out of the rows the UDF
    scores, not scored and discarded), so one bad row cannot fail the batch it would have been in."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    text, error = checked_text(frame, TEXT, max_chars, text_column)  # no text refused by Spark SQL reaches Python
    checked = frame.select(ID, text.alias(TEXT), error.alias("error"))
    refused = checked.where(F.col("error").isNotNull()).select(
        ID, F.lit(None).cast("string").alias("label"), F.lit(None).cast("double").alias("score"), "error")
    if not isinstance(frame.schema[TEXT].dataType, StringType):
        return refused  # nothing in a column of another type is a review
    # the UDF's struct is a column first and split after, so Spark calls the model once per row, not once per field
    answer = model_udf(F.struct(F.col(TEXT).alias(TEXT_COLUMN))).alias(ANSWER)
    scored = (checked.where(F.col("error").isNull()).select(ID, answer, "error")
              .select(ID, f"{ANSWER}.label", f"{ANSWER}.score", "error"))
    return scored.unionByName(refused)
