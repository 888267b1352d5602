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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Rows per Arrow batch handed to the model's `predict` (Spark's `arrow.maxRecordsPerBatch`): as many texts as
#: `SentimentPredictor` tokenizes at once, so a batch of long reviews stays small in memory.
BATCH_ROWS = 2048
#: Seconds between two progress lines.
PROGRESS_EVERY_S = 10.0
#: The input formats by file suffix, and each format's suffixes as a Hadoop glob (Spark's `pathGlobFilter`).
FORMAT_OF_SUFFIX = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
SUFFIXES = {"csv": (".csv",), "parquet": (".parquet", ".pq")}
SPARK_GLOB = {"csv": "*.{csv,CSV}", "parquet": "*.{parquet,pq,PARQUET,PQ}"}
#: The column a CSV row whose fields do not match the header keeps its line in (`read_csv_input`).
MALFORMED_ROW = "_malformed_row"


def spark_path(path: str) -> str:
    """`path` as Spark should be given it: a URI (`s3a://`, `hdfs://`, `file:`) unchanged, a local path made absolute
    (Spark's JVM resolves a relative one against its own working directory, not this process's)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        return path
    return str(Path(path).absolute())


def local_path(path: str) -> Path | None:
    """The local file `path` names (a plain path, or a `file:` URI), None on another file system (`s3a://`, ...)."""
    if path.startswith("file:"):
        return Path(unquote(urlparse(path).path))
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        return None
    return Path(path)


def read_files(folder: Path) -> list[Path]:
    """The files directly in `folder` that Spark reads: not in subfolders, not hidden (`.name`) and not its own
    bookkeeping (`_SUCCESS`, `_committed_*`)."""
    return sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith(("_", ".")))


def input_format(path: str, fmt: str = "auto") -> str:
    """"parquet" or "csv": `fmt` when given, else by the name (`.csv`, `.parquet`/`.pq`), and for a local folder by
    the files directly in it (`read_files`): CSV files, Parquet files, or only subfolders (Parquet's `key=value`
    layout). A folder of both formats, or of neither, is a `ValueError`: Spark would read every file as one format."""
    if fmt != "auto":
        return fmt
    lowered = path.lower().rstrip("/")
    if lowered.endswith(".csv"):
        return "csv"
    if lowered.endswith((".parquet", ".pq")):
        return "parquet"
    folder = local_path(path)
    if folder is None or not folder.is_dir():
        return "parquet"
    files = read_files(folder)
    kinds = {kind for f in files if (kind := FORMAT_OF_SUFFIX.get(f.suffix.lower()))}
    if len(kinds) > 1:
        raise ValueError(f"{path} holds both CSV and Parquet files: pass --format to read one kind (the other is "
                         "skipped), or give each its own folder")
    if kinds:
        return kinds.pop()
    if files or not any(d.is_dir() and "=" in d.name for d in folder.iterdir()):  # `key=value`: Parquet's layout
        raise ValueError(f"{path} holds no .csv or .parquet file directly in it (Spark reads a folder's own files, "
                         "not its subfolders'; Parquet's key=value subfolders excepted)")
    return "parquet"


def check_input(path: str, fmt: str) -> None:
    """Refuse, before Spark starts, a local input that Spark would read wrongly or fail on late: a path that is not
    there, a file of the other format (Parquet files begin with `PAR1`), and a CSV file that is not UTF-8 (Spark
    would score its undecodable bytes as U+FFFD, silently). Inputs on other file systems are Spark's to check."""
    local = local_path(path)
    if local is None:
        return
    if not local.exists():
        raise ValueError(f"{path} does not exist")
    files = [f for f in read_files(local) if f.suffix.lower() in SUFFIXES[fmt]] if local.is_dir() else [local]
    for file in files:
        with file.open("rb") as f:
            parquet = f.read(4) == b"PAR1"
        if parquet != (fmt == "parquet"):
            raise ValueError(f"{file} is {'a Parquet' if parquet else 'not a Parquet'} file, but is read as {fmt}: "
                             "pass --format " + ("parquet" if parquet else "csv"))
        if fmt == "csv":
            check_utf8(file)


def check_utf8(file: Path, chunk_bytes: int = 1 << 20) -> None:
    """`ValueError` naming the byte offset where `file` stops being UTF-8 (read in chunks: any size)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with file.open("rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{file} is not UTF-8 (byte {offset + exc.start}: {exc.reason}): save it as UTF-8 "
                                 "(Spark would score the bytes it cannot read as U+FFFD)") from None
            if not chunk:
                return
            offset += len(chunk)


def check_output(input_path: str, output_path: str, overwrite: bool) -> None:
    """Refuse, before Spark starts, an output that would destroy data or fail late: the input itself, a folder
    holding the input or inside an input folder, an output that exists without `overwrite`, and, with it, anything
    but an earlier output of Spark's (a folder with `_SUCCESS`, or only part files and Spark's bookkeeping): Spark's
    overwrite deletes whatever is there first. Paths on other file systems are compared by name only."""
    out, inp = local_path(output_path), local_path(input_path)
    if out is None or inp is None:
        if output_path.rstrip("/") == input_path.rstrip("/"):
            raise ValueError(f"the output {output_path} is the input: write the answers elsewhere")
        return
    out, inp = out.resolve(), inp.resolve()
    if out == inp or out in inp.parents or (inp.is_dir() and inp in out.parents):
        raise ValueError(f"the output {output_path} is the input, holds it or lies inside it: write the answers "
                         "elsewhere (Spark's overwrite deletes the output before it writes)")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ValueError(f"{output_path} exists: pass --overwrite to replace it (an earlier output of this command)")
    if not out.is_dir() or out.is_symlink():
        raise ValueError(f"{output_path} is not a folder Spark wrote: refusing to replace it with --overwrite")
    foreign = [e.name for e in out.iterdir() if not (e.is_file() and e.name.startswith(("part-", "_", ".")))]
    if foreign and not (out / "_SUCCESS").is_file():
        raise ValueError(f"{output_path} holds {', '.join(sorted(foreign)[:3])}{' ...' if len(foreign) > 3 else ''}, "
                         "which Spark did not write: refusing to delete it with --overwrite")


def output_format(path: str) -> str:
    """CSV when the output's name ends in `.csv`, else Parquet."""
    return "csv" if path.lower().rstrip("/").endswith(".csv") else "parquet"


def read_input(spark: SparkSession, path: str, fmt: str) -> DataFrame:
    """The input as Spark reads it, in partitions: of a local folder, only its files of format `fmt` (a README
    beside the data is not read as data). CSV: `read_csv_input`."""
    local = local_path(path)
    glob = SPARK_GLOB[fmt] if local is not None and local.is_dir() else None
    if glob is not None:
        skipped = [f.name for f in read_files(local) if f.suffix.lower() not in SUFFIXES[fmt]]  # type: ignore[arg-type]
        if skipped:
            print(f"reading only the {fmt} files of {path}; skipped: {', '.join(skipped[:5])}"
                  f"{' ...' if len(skipped) > 5 else ''}", file=sys.stderr)
    if fmt == "csv":
        return read_csv_input(spark, path, glob)
    reader = spark.read if glob is None else spark.read.option("pathGlobFilter", glob)
    return reader.parquet(path)


def read_csv_input(spark: SparkSession, path: str, glob: str | None = None) -> DataFrame:
    """A CSV input with `MALFORMED_ROW`: every column a string (a review "42" stays the text "42"), quoted fields
    may span lines and hold doubled quotes (RFC 4180), an empty field is null; a row whose fields do not match the
    header's (an unquoted comma splits a review) keeps its line in `MALFORMED_ROW` instead of being padded or cut
    silently (Spark's PERMISSIVE mode), so it can be answered with an error."""
    from pyspark.sql.types import StringType, StructField, StructType

    options = {"header": True, "multiLine": True, "escape": '"'}
    if glob is not None:
        options["pathGlobFilter"] = glob
    columns = spark.read.csv(path, **options).columns  # the header's names, as Spark reads them
    if MALFORMED_ROW in columns:
        raise ValueError(f"{path} has a column named {MALFORMED_ROW!r}, which batch scoring uses itself")
    schema = StructType([StructField(c, StringType()) for c in [*columns, MALFORMED_ROW]])
    return spark.read.csv(path, schema=schema, mode="PERMISSIVE", columnNameOfCorruptRecord=MALFORMED_ROW,
                          **options)


def read_csv(spark: SparkSession, path: str) -> DataFrame:
    """The written CSV answers as `count_output` reads them back: the options of the input's reading, so a field the
    writer quoted across lines (an id or review holding a newline) is one row when it is counted back too."""
    return spark.read.csv(path, header=True, multiLine=True, escape='"')


def write_output(frame: DataFrame, path: str, overwrite: bool) -> None:
    """Spark's own writer, partition by partition: a Parquet folder, or a folder of CSV parts with a header each
    when the name ends in .csv (quotes in a field doubled, as RFC 4180 and pandas read them)."""
    writer = frame.write.mode("overwrite" if overwrite else "errorifexists")
    if output_format(path) == "csv":
        # the writer trims each field by default: an id " r1 " would come back "r1" (and collide with another)
        writer.csv(path, header=True, escape='"', ignoreLeadingWhiteSpace=False, ignoreTrailingWhiteSpace=False)
    else:
        writer.parquet(path)


def count_output(spark: SparkSession, path: str) -> tuple[int, int]:
    """(rows, rows with an error) of the written output, read back from storage."""
    from pyspark.sql import functions as F

    fmt = output_format(path)
    written = read_csv(spark, path) if fmt == "csv" else spark.read.parquet(path)
    row = written.agg(F.count(F.lit(1)).alias("rows"), F.count("error").alias("errors")).first()
    return int(row["rows"]), int(row["errors"])


@contextmanager
def progress_lines(spark: SparkSession, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """While the body runs, a line on stderr every `every_s` seconds with the partitions (tasks) done of each
    running Spark stage."""
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()
    started = time.monotonic()

    def report() -> None:
        while not stop.wait(every_s):
            stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            done = [f"stage {s.stageId}: {s.numCompletedTasks}/{s.numTasks} partitions done, {s.numActiveTasks} "
                    f"running" for s in stages if s is not None]
            if done:
                print(f"[{time.monotonic() - started:.0f} s] " + "; ".join(done), file=sys.stderr, flush=True)

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
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(master).appName("imdb-sentiment batch scoring")
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
