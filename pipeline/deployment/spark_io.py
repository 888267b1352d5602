"""Spark's side of batch scoring (`pipeline.deployment.batch_scoring`): the session and how its tasks share the
cores, where files are and in which format, reading the input and writing the answers partition by partition,
counting what was written, and progress lines while Spark works."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.deployment.batch_failures import java_causes
from pipeline.deployment.batch_inputs import files_to_read, hadoop_literal, local_path, read_files
from pipeline.deployment.batch_rows import MALFORMED_ROW
from pipeline.deployment.input_columns import parquet_columns, pick_columns, spark_type

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Rows per Arrow batch handed to the model's `predict` (Spark's `arrow.maxRecordsPerBatch`): as many texts as
#: `SentimentPredictor` tokenizes at once, so a batch of long reviews stays small in memory.
BATCH_ROWS = 2048
#: The driver JVM's options in local mode, where it is started here: C1 only, one compiler thread, the serial
#: collector. The driver's own work (reading and writing files, moving Arrow batches) is small next to the model's in
#: the Python workers, and on a few cores C2's compiler threads and G1's collector threads took CPU from the model
#: (docs/serving.md, "Scoring a file or a table"); TorchServe's frontend runs C1 only for the same reason
#: (serving/config.properties). A cluster's driver, and one whose options the caller set (`PYSPARK_SUBMIT_ARGS`), is
#: left as configured.
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC"
#: The local-mode driver's log configuration: Spark's defaults at WARN, less a warning every start prints.
LOCAL_LOG_CONFIG = Path(__file__).with_name("spark-log4j2.properties")
#: Where a local-mode driver listens (`SPARK_LOCAL_IP`, unless the caller set it): its RPC endpoint, block manager
#: and web UI, which Spark otherwise binds to every interface (the UI, unauthenticated, could also kill jobs).
LOCAL_BIND_ADDRESS = "127.0.0.1"
#: Seconds between two progress lines.
PROGRESS_EVERY_S = 10.0
#: Spark's error for a CSV file whose header is not the columns it reads (`enforceSchema` off).
HEADER_MISMATCH = re.compile(r"CSV header does not conform to the schema\.\s*Header: (?P<header>[^\n]*)\s*"
                             r"Schema: (?P<schema>[^\n]*)\s.*?CSV file: (?P<file>\S+)", re.S)
#: How every CSV here is read, the input and the written answers alike: a header row, quoted fields that may span
#: lines and hold doubled quotes (RFC 4180).
CSV_READ = {"header": True, "multiLine": True, "escape": '"'}


def spark_path(path: str) -> str:
    """`path` as Spark should be given it: a URI (`s3a://`, `hdfs://`, `file:`) unchanged, a local path made absolute
    (Spark's JVM resolves a relative one against its own working directory, not this process's)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        return path
    return str(Path(path).absolute())


def output_format(path: str) -> str:
    """CSV when the output's name ends in `.csv`, else Parquet."""
    return "csv" if path.lower().rstrip("/").endswith(".csv") else "parquet"


def read_input(spark: SparkSession, path: str, fmt: str, wanted: Mapping[str, str] | None = None,
               absent: str | None = None) -> DataFrame:
    """The input as Spark reads it, in partitions: of a local folder, only its files named as format `fmt` where
    any is (`batch_inputs.files_to_read`: a README beside the data is not read as data), each named for Spark as
    itself even where its name holds a glob character (`hadoop_literal`). With `wanted` (option -> column name),
    only those columns (`input_columns.pick_columns`, which also refuses a column named as `absent`), and for a CSV
    `MALFORMED_ROW` (`read_csv_input`); a Parquet input is read with them alone as its schema, so that no other
    column matters."""
    from pyspark.sql.types import StructField, StructType

    local = local_path(path, local_master=spark.sparkContext.master.startswith("local"))
    files = files_to_read(local, fmt) if local is not None and local.is_dir() else None
    paths = [hadoop_literal(str(f)) for f in files] if files else [path]
    if local is not None and files:
        skipped = [f.name for f in read_files(local) if f not in files]
        if skipped:
            print(f"reading only the {fmt} files of {path}; skipped: {', '.join(skipped[:5])}"
                  f"{' ...' if len(skipped) > 5 else ''}", file=sys.stderr)
    if fmt == "csv":
        frame = read_csv_input(spark, paths)
        if wanted is None:
            return frame
        chosen = pick_columns([(f.name, f.dataType) for f in frame.schema.fields], wanted, path, absent)
        return frame.select(*dict.fromkeys(quoted(name) for name, _ in chosen.values()), MALFORMED_ROW)
    if wanted is None:
        return spark.read.parquet(*paths)
    footers = files or ([local] if local is not None and local.is_file() else [])
    chosen = pick_columns(parquet_columns(spark, paths, footers), wanted, path, absent)
    fields = {name: StructField(name, spark_type(name, kind, path)) for name, kind in chosen.values()}
    return spark.read.schema(StructType(list(fields.values()))).parquet(*paths)


def quoted(name: str) -> str:
    """`name` as a Spark column reference that means that column alone (a dot would reach into a struct)."""
    return "`" + name.replace("`", "``") + "`"


def read_csv_input(spark: SparkSession, paths: list[str]) -> DataFrame:
    """A CSV input (files or folders) with `MALFORMED_ROW`: every column a string (a review "42" stays the text
    "42"), quoted fields may span lines and hold doubled quotes (RFC 4180), an empty field is null; a row whose
    fields do not match the header's (an unquoted comma splits a review) keeps its line in `MALFORMED_ROW` instead of
    being padded or cut silently (Spark's PERMISSIVE mode), so it can be answered with an error. The columns are
    named by one file's header, and every file's header must be that one (`enforceSchema` off: Spark reads each
    file's columns by position, so a file listing them in another order had its ids and texts swapped); a file
    whose header differs fails the first pass over the input (`count_input`)."""
    from pyspark.sql.types import StringType, StructField, StructType

    columns = spark.read.csv(paths, **CSV_READ).columns  # the header's names, as Spark reads them
    if MALFORMED_ROW in columns:
        raise ValueError(f"{', '.join(paths)} has a column named {MALFORMED_ROW!r}, which batch scoring uses itself")
    schema = StructType([StructField(c, StringType()) for c in [*columns, MALFORMED_ROW]])
    return spark.read.csv(paths, schema=schema, mode="PERMISSIVE", columnNameOfCorruptRecord=MALFORMED_ROW,
                          enforceSchema=False, **CSV_READ)


def count_input(frame: DataFrame) -> int:
    """The input's rows: the first pass over it, where Spark finds a CSV file whose header is not the others'
    (`read_csv_input`), which is a `ValueError` naming the file."""
    try:
        return frame.count()
    except Exception as exc:
        for message in java_causes(exc):
            found = HEADER_MISMATCH.search(message)
            if found is not None:
                raise ValueError(f"the CSV files' headers differ: {found['file']} has {found['header']}, another "
                                 f"{found['schema']} (Spark would read its columns by position, swapping them): "
                                 "give every file the same columns in the same order, or score them apart") from None
        raise


def read_csv(spark: SparkSession, path: str) -> DataFrame:
    """The written CSV answers as `count_output` reads them back: the options of the input's reading, so a field the
    writer quoted across lines (an id or review holding a newline) is one row when it is counted back too."""
    return spark.read.csv(path, **CSV_READ)


def write_output(frame: DataFrame, path: str, overwrite: bool) -> None:
    """Spark's own writer, partition by partition: a Parquet folder, or a folder of CSV parts with a header each
    when the name ends in .csv (quotes in a field doubled, as RFC 4180 and pandas read them)."""
    writer = frame.write.mode("overwrite" if overwrite else "errorifexists")
    if output_format(path) == "csv":
        # the writer trims each field by default: an id " r1 " would come back "r1" (and collide with another)
        writer.csv(path, header=True, escape='"', ignoreLeadingWhiteSpace=False, ignoreTrailingWhiteSpace=False)
    else:
        writer.parquet(path)


@dataclass(frozen=True)
class Written:
    """What the written output holds, read back from storage: its rows, those with an error, and the rows whose id
    is null or is another row's too (counted only for an id column of the input's: the added one is unique)."""

    rows: int
    errors: int
    null_ids: int = 0
    repeated_ids: int = 0


def count_output(spark: SparkSession, path: str, id_column: str | None = None) -> Written:
    """The output at `path` counted (`Written`), with the nulls and repeats of `id_column` where one is given (one
    Spark cannot compare, a map, is not checked for repeats)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import MapType

    fmt = output_format(path)
    written = read_csv(spark, path) if fmt == "csv" else spark.read.parquet(path)
    counts = [F.count(F.lit(1)).alias("rows"), F.count("error").alias("errors")]
    if id_column is not None:
        ids = F.col(quoted(id_column))
        counts.append(F.count(ids).alias("ids"))
        if not isinstance(written.select(ids).schema[0].dataType, MapType):
            counts.append(F.count_distinct(ids).alias("distinct_ids"))
    row = written.agg(*counts).first().asDict()
    ids = row.get("ids", row["rows"])
    return Written(rows=row["rows"], errors=row["errors"], null_ids=row["rows"] - ids,
                   repeated_ids=ids - row.get("distinct_ids", ids))


def progress_line(elapsed_s: float, stages: Sequence[Any], partitions: int | None = None) -> str | None:
    """The line for Spark's running `stages` (`SparkStageInfo`s), None where none runs: the tasks done and running
    of each. A stage of twice `partitions` tasks is the write, where each partition's scored rows and refused rows
    (the two halves the answers are joined from) are a task each."""
    parts = []
    for stage in stages:
        halves = " (each partition's scored and refused rows)" if stage.numTasks == 2 * (partitions or 0) else ""
        parts.append(f"stage {stage.stageId}: {stage.numCompletedTasks}/{stage.numTasks} tasks done{halves}, "
                     f"{stage.numActiveTasks} running")
    return f"[{elapsed_s:.0f} s] " + "; ".join(parts) if parts else None


@contextmanager
def progress_lines(spark: SparkSession, partitions: int | None = None,
                   every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """While the body runs, a line on stderr every `every_s` seconds with the tasks done of each running Spark
    stage (`progress_line`; `partitions`: how many the rows were dealt into)."""
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()
    started = time.monotonic()

    def report() -> None:
        while not stop.wait(every_s):
            stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            line = progress_line(time.monotonic() - started, [s for s in stages if s is not None], partitions)
            if line is not None:
                print(line, file=sys.stderr, flush=True)

    thread = threading.Thread(target=report, name="scoring-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def spark_session(master: str, task_threads: int = 1, batch_rows: int = BATCH_ROWS,
                  shuffle_partitions: int | None = None) -> SparkSession:
    """The running Spark session, or a new one on `master`. Each task (one partition being scored) gets
    `task_threads` cores (`spark.task.cpus`) and its Python worker caps the model's intra-op threads to them
    (`OMP_NUM_THREADS`, read by every runtime), so the tasks running at once share the cores without spinning
    against each other. In local mode the workers run this Python (the project's venv)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:  # a caller's (a notebook's, a test's): used as it is, its configuration left alone
        print(f"using the running Spark session on {active.sparkContext.master}: its own settings stay, so master "
              f"{master}, {task_threads} core(s) per task and {batch_rows} rows per batch are not applied",
              file=sys.stderr)
        return active
    builder = SparkSession.builder
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        # A local job needs no network: every port of the driver on loopback. Spark reads SPARK_LOCAL_IP from the
        # environment of the JVM it starts (the web UI reads nothing else); the UI's kill links are off too, as
        # any user of the machine can reach it (Ctrl-C stops the command).
        os.environ.setdefault("SPARK_LOCAL_IP", LOCAL_BIND_ADDRESS)
        builder = builder.config("spark.ui.killEnabled", "false")
        if "PYSPARK_SUBMIT_ARGS" not in os.environ:
            builder = builder.config("spark.driver.extraJavaOptions", local_driver_java_options())
    builder = (builder.master(master).appName("imdb-sentiment batch scoring")
               .config("spark.task.cpus", str(task_threads))
               .config("spark.executorEnv.OMP_NUM_THREADS", str(task_threads))
               .config("spark.executorEnv.TOKENIZERS_PARALLELISM", "false")
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(batch_rows))
               .config("spark.ui.showConsoleProgress", "false"))  # progress_lines reports instead
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def local_driver_java_options() -> str:
    """The options a local-mode driver JVM started here gets: `LOCAL_DRIVER_JAVA_OPTIONS` and `LOCAL_LOG_CONFIG`."""
    return f"{LOCAL_DRIVER_JAVA_OPTIONS} -Dlog4j2.configurationFile={LOCAL_LOG_CONFIG.as_uri()}"


@contextmanager
def session_for(master: str, task_threads: int = 1, batch_rows: int = BATCH_ROWS,
                shuffle_partitions: int | None = None) -> Iterator[SparkSession]:
    """`spark_session` for the block. A session that was already running (a notebook's, a test's) is left running;
    one started here is stopped at the end, and the SIGINT handler from before it is put back: SparkContext
    installs its own (cancel every job, then KeyboardInterrupt) and `stop()` leaves it in place, where a Ctrl-C,
    or the SIGINT pytest-xdist's execnet sends a worker still busy at shutdown, would fail inside it (`'NoneType'
    object has no attribute 'sc'`) instead of interrupting."""
    from pyspark.sql import SparkSession

    owned = SparkSession.getActiveSession() is None
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main_thread else None
    spark = spark_session(master, task_threads, batch_rows, shuffle_partitions)
    try:
        yield spark
    finally:
        if owned:
            spark.stop()
            if handler is not None:  # None: installed outside Python, or not the main thread (Spark installed none)
                signal.signal(signal.SIGINT, handler)
