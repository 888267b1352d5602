"""Each row's checks in batch scoring (`pipeline.deployment.batch_scoring`), made on Spark's executors: the
contract's own `check_text` in a pandas UDF (`text_errors`), after Spark SQL itself has refused what must never
cross into Python (`checked_text`): a text longer than the limit, which would swell the Arrow batch the JVM builds
for the UDF (a batch of very long texts made it run out of direct memory and hang), and one not valid UTF-8,
which Python cannot decode (the whole job failed). One bad row never fails a batch.

The checks are plain Python (no third-party import at the top): Spark ships them to the executors by value
(`ship_checks_by_value`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from pipeline.deployment.protocol import RequestError, check_text

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType

#: The column a CSV row whose fields do not match the header keeps its line in (`spark_io.read_csv_input`).
MALFORMED_ROW = "_malformed_row"
#: The error of a CSV row whose fields do not match the header's (`spark_io.read_csv_input`).
MALFORMED_MESSAGE = ("malformed CSV row: its fields do not match the header's columns (an unquoted comma or quote "
                     "in a field?); not scored")
#: The most bytes of text one Arrow batch may hold (`arrow_batch_rows`): rows per batch x the longest text allowed
#: x 4 (UTF-8's longest character). The JVM builds each batch in direct memory, which is as large as its heap by
#: default (1 GiB for `local`), in buffers that double as they grow: 256 MiB keeps two tasks' batches within it,
#: and is 2,048 rows of the default 20,000 characters.
ARROW_BATCH_BYTES = 256 * 2**20


def arrow_batch_rows(batch_rows: int, max_chars: int) -> int:
    """Rows per Arrow batch: `batch_rows`, fewer where that many texts of `max_chars` characters could pass
    `ARROW_BATCH_BYTES` (longer texts never reach a batch: `checked_text`)."""
    return max(1, min(batch_rows, ARROW_BATCH_BYTES // (4 * max(1, max_chars))))


def text_errors(values: pd.Series, where: str, max_chars: int) -> pd.Series:
    """The contract's refusal of each value (`check_text` with `max_chars` characters at most), or None where the
    value is a review the model may score. Runs in Spark's Python workers, one Arrow batch at a time."""
    import pandas as pd

    def error(value: Any) -> str | None:
        try:
            check_text(value, where, max_chars)
        except RequestError as exc:
            return exc.message
        return None

    return pd.Series([error(v) for v in values], index=values.index, dtype=object)


def type_error(where: str, dtype: DataType) -> str:
    """The contract's message for a text column Spark typed as something else (every value of it is refused)."""
    from pyspark.sql.types import BooleanType, NumericType

    kind = ("a number" if isinstance(dtype, NumericType) else "a boolean" if isinstance(dtype, BooleanType)
            else dtype.simpleString())
    return f"{where} must be a string, got {kind}"


def sql_error(text: Column, max_chars: int, where: str) -> Column:
    """What Spark SQL refuses itself, null otherwise: a text of more than `max_chars` characters, with the
    contract's message (`check_text`'s: Spark's `length` counts code points, as Python's `len`), and one that is
    not valid UTF-8 (decoding and encoding it again would change its bytes)."""
    from pyspark.sql import functions as F

    too_long = F.concat(F.lit(f"{where} has "), F.length(text).cast("string"),
                        F.lit(f" characters, more than the limit of {max_chars}"))
    return (F.when(F.length(text) > max_chars, too_long)
            .when(F.encode(text, "UTF-8") != text.cast("binary"), F.lit(f"{where} is not valid UTF-8")))


def checked_text(frame: DataFrame, column: str, max_chars: int, where: str) -> tuple[Column, Column]:
    """(the text to hand on, the `error` column) for `frame`'s text column `column`, the errors naming it `where`:
    the contract's message for a refused text, null for a text to score. A string column is checked by Spark SQL
    first (`sql_error`), and the texts it refuses are handed on as null, so that no Arrow batch carries them, then
    value by value in a pandas UDF (the contract's own `check_text`); a column of another type refuses every row
    (null: "got null"); a CSV row whose fields do not match the header's (`MALFORMED_ROW`) is refused whatever its
    text."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    text = F.col(column)
    dtype = frame.schema[column].dataType
    if not isinstance(dtype, StringType):
        checked = (F.when(text.isNull(), F.lit(f"{where} must be a string, got null"))
                   .otherwise(F.lit(type_error(where, dtype))))
    else:
        import pandas as pd

        def check(values: pd.Series) -> pd.Series:
            return text_errors(values, where, max_chars)

        # Spark reads a pandas UDF's kind from its hints, which this module's `from __future__ import annotations`
        # leaves as strings: give it the classes
        check.__annotations__ = {"values": pd.Series, "return": pd.Series}
        refused = sql_error(text, max_chars, where)
        text = F.when(refused.isNull(), text)
        # marked nondeterministic only to steer the optimizer: it then computes the column once per row where it is
        # selected, instead of inlining the call again into each filter on `error` and into the projection above it
        checked = F.coalesce(refused, F.pandas_udf(check, "string").asNondeterministic()(text))
    if MALFORMED_ROW in frame.columns:
        checked = F.when(F.col(MALFORMED_ROW).isNotNull(), F.lit(MALFORMED_MESSAGE)).otherwise(checked)
    return text, checked


def ship_checks_by_value() -> None:
    """Let Spark pickle the row checks (this module and the contract's) by value, so the executors need no copy of
    the project to run them: on a cluster only the model carries the project's code."""
    from pyspark import cloudpickle

    from pipeline.data import cleaning
    from pipeline.deployment import protocol

    cloudpickle.register_pickle_by_value(protocol)
    cloudpickle.register_pickle_by_value(cleaning)  # the contract's checks clean a text as the model reads it
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
