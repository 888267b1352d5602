"""Which of the input's columns batch scoring (`pipeline.deployment.batch_scoring`) reads, and as what: the text's
and the id's, nothing else (`pick_columns`), so that a column it does not use cannot fail the job. Spark infers a
Parquet input's schema from every column, and fails on some it cannot read (pyarrow's default `timestamp[ns]`,
`time64`) or tell apart (`text` and `TEXT`); where it does and the files are local, the schema is read from a
footer with pyarrow instead (`parquet_columns`), and Spark is given the wanted columns alone as its schema.
Names are matched ignoring case, as Spark matches them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.deployment.batch_rows import MALFORMED_ROW

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DataType


def parquet_columns(spark: SparkSession, paths: Sequence[str], footers: Sequence[Path]) -> list[tuple[str, Any]]:
    """Every column of a Parquet input and its type: Spark's (`DataType`) where Spark infers the schema, else, for
    local files (`footers`), pyarrow's of the first one (an Arrow type); a `ValueError` where pyarrow cannot read
    that footer, or finds a float16 column, which Spark 3.5 cannot read even where it is not asked for."""
    try:
        with spark_logs_off(spark) if footers else nullcontext():  # a failure here is handled: not logged
            return [(field.name, field.dataType) for field in spark.read.parquet(*paths).schema.fields]
    except Exception:
        if not footers:
            raise
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(footers[0])
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{footers[0]} cannot be read as Parquet ({exc}): is it truncated or damaged?") from None
    halves = [field.name for field in schema if pa.types.is_float16(field.type)]
    if halves:
        raise ValueError(f"{footers[0]} has a float16 column ({', '.join(halves)}), which Spark cannot read, even "
                         "where it is not used: cast it to float32, or drop it")
    return [(field.name, field.type) for field in schema]


@contextmanager
def spark_logs_off(spark: SparkSession) -> Iterator[None]:
    """Spark's log lines off for the block, its level put back after: an attempt whose failure is expected and
    handled would print a Java stack trace for each failed task."""
    level = str(spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel())
    spark.sparkContext.setLogLevel("OFF")
    try:
        yield
    finally:
        spark.sparkContext.setLogLevel(level)


def spark_type(name: str, kind: Any, where: str) -> DataType:
    """`kind` as Spark's type: itself when Spark inferred it, else converted from Arrow's (a dictionary-encoded column
    as its values' type); a `ValueError` for a type Spark cannot read."""
    from pyspark.sql.types import DataType

    if isinstance(kind, DataType):
        return kind
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_type

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    try:
        return from_arrow_type(kind)
    except Exception:
        raise ValueError(f"{where}: its column {name!r} is {kind}, which Spark cannot read: convert it") from None


def pick_columns(columns: Sequence[tuple[str, Any]], wanted: Mapping[str, str], where: str,
                 absent: str | None = None) -> dict[str, tuple[str, Any]]:
    """For each wanted column (the option that names it -> its name), the input's column of that name ignoring case,
    as (its name in the input, its type). A `ValueError` for a name the input lacks (listing its columns), a name
    it holds twice ignoring case (Spark cannot tell them apart), and a column `absent` names (the one the output
    would add)."""
    names = [name for name, _ in columns if name != MALFORMED_ROW]
    chosen = {}
    for option, name in wanted.items():
        found = [(column, kind) for column, kind in columns if column.lower() == name.lower()]
        if not found:
            renamed = [n for n in names if n.lower().startswith(name.lower()) and n[len(name):].isdigit()]
            hint = (f" (a CSV header that repeats a name has its copies renamed by position: {', '.join(renamed)})"
                    if renamed else "")
            raise ValueError(f"{where} has no column {name!r} ({option}); its columns: {', '.join(names)}{hint}")
        if len(found) > 1:
            raise ValueError(f"{where} has {len(found)} columns named {name!r} ignoring case "
                             f"({', '.join(column for column, _ in found)}), which Spark cannot tell apart: rename "
                             "all but one")
        chosen[option] = found[0]
    if absent is not None and absent.lower() in (n.lower() for n in names):
        raise ValueError(f"{where} already has a column {absent!r}: name it with --id-column")
    return chosen


def check_csv_id(dtype: DataType, id_column: str) -> None:
    """`ValueError` for an id column a CSV output cannot hold (binary, or nested: a struct, an array, a map)."""
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StructType

    if isinstance(dtype, (BinaryType, StructType, ArrayType, MapType)):
        raise ValueError(f"the id column {id_column!r} is {dtype.simpleString()}, which a CSV output cannot hold: "
                         "write Parquet (an output whose name does not end in .csv)")
