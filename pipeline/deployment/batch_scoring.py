"""Score a Parquet or CSV file, or a folder of them, with a registered MLflow model on Apache Spark:
`python -m pipeline.deployment.batch_scoring --input reviews.parquet --output scored.parquet`
(`make score INPUT=... OUTPUT=...`).

The model is `models:/<mlflow.registered_model_name>@<mlflow.champion_alias>` (the champion `make run` registers)
or any `--model-uri` MLflow loads (`models:/<name>/<version>`, `models:/<model id>`, a path). It runs as MLflow's
own Spark UDF (`mlflow.pyfunc.spark_udf`, in `pipeline.deployment.mlflow_model`): Spark reads the input in
partitions, each Python worker loads the model once and scores Arrow batches of `--batch-rows` texts with the
pyfunc's `predict`, and Spark writes the answers partition by partition, so no step holds the whole input in
memory. `--master` is `local[*]` (every core of this machine) or a cluster's master URL, passed to Spark unchanged.

Output: one row per input row, not in the input's order (join on the id column), with the id column, `label`,
`score` and `error`; a warning says when ids are null or repeated. Only the text and id columns are read
(`input_columns`). A text the endpoint's contract refuses (`pipeline.deployment.protocol.check_text`: null, not a
string, empty or whitespace only, no visible character, longer than `package.max_chars_per_text`; and one that is
not valid UTF-8) gets the contract's message in `error` and no label or score; it is checked before the model sees
it (the over-long and undecodable ones by Spark SQL, before any text crosses into Python: `batch_rows`), so one bad
row never fails a batch and the job goes on. Without `--id-column` a `row_id` column is added (Spark's
`monotonically_increasing_id`: unique and increasing through the input as read, not consecutive). A CSV row whose
fields do not match the header's is answered `malformed CSV row`, and a CSV file whose header is not the others'
stops the job. Before Spark starts, the command refuses an output that would destroy data (the input, a folder
holding it, anything but an earlier output under `--overwrite`, a name Spark would read as a glob) and an input
Spark would misread (not UTF-8, the other format, a folder of two formats, a file cut short):
`batch_inputs.check_output`, `check_input`. A local output is written into a hidden folder beside it and renamed
onto OUTPUT once read back and counted (`batch_output`); a row count other than the input's fails the command (exit
1) and leaves OUTPUT as it was, and so does SIGINT or SIGTERM, which cancel Spark's jobs and exit 130 or 143 with
one line (`batch_failures`; any other error of Spark's is one line too, exit 1). An `hdfs://` or `s3a://` output is
written in place, complete once it holds `_SUCCESS`. Progress lines go to stderr while Spark works; the summary
(rows, scored, errors, seconds, rows/s) to stdout, and to `--summary-json` when given.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.io import write_json
from pipeline.deployment.batch_failures import StopOnSignals, interruption_point, spark_error_exit, stop_on_signals
from pipeline.deployment.batch_inputs import (
    check_columns,
    check_master,
    check_model,
    check_output,
    check_paths,
    check_task_threads,
)
from pipeline.deployment.batch_output import recover_abandoned, staged_output
from pipeline.deployment.batch_plan import ID, PARTITION_ROWS, TEXT, default_partitions, scored_frame, task_slots
from pipeline.deployment.batch_rows import ARROW_BATCH_BYTES, MALFORMED_ROW, arrow_batch_rows, ship_checks_by_value
from pipeline.deployment.input_columns import check_csv_id
from pipeline.deployment.spark_io import (
    BATCH_ROWS,
    count_input,
    count_output,
    output_format,
    progress_lines,
    quoted,
    read_input,
    session_for,
    spark_path,
    write_output,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The id column added when the input names none.
ADDED_ID_COLUMN = "row_id"


@dataclass(frozen=True, kw_only=True)
class ScoringSummary:
    """What one scoring job did: rows read and written (equal, or the command fails), scored and refused rows,
    the job's wall time (reading, checking, scoring, writing, counting the output) and its rate."""

    input: str
    output: str
    model_uri: str
    master: str
    id_column: str
    id_added: bool
    partitions: int
    rows_in: int
    rows_out: int
    scored: int
    errors: int
    seconds: float
    rows_per_s: float


class RowCountMismatch(RuntimeError):
    """The output holds another number of rows than the input: rows were lost or duplicated."""


def score(spark: SparkSession, input_path: str, output_path: str, model_uri: str, *, max_chars: int,
          id_column: str | None = None, text_column: str = "text", input_fmt: str = "auto",
          partitions: int | None = None, env_manager: str = "local", overwrite: bool = False,
          paths_checked: bool = False) -> ScoringSummary:
    """Score `input_path` into `output_path` with the model at `model_uri` on `spark`, refusing texts over
    `max_chars` characters (`package.max_chars_per_text`, as the servers do); raises `RowCountMismatch` when the
    output's row count is not the input's, `ValueError` for a missing column or an input or output refused by
    `batch_inputs.check_paths` (checked first, before Spark reads anything; `paths_checked`: the caller has, with
    `input_fmt` the format it resolved, so a CSV is not read through a second time)."""
    from pyspark.sql import functions as F

    from pipeline.deployment.mlflow_model import spark_model_udf

    input_path, output_path = spark_path(input_path), spark_path(output_path)
    local_master = spark.sparkContext.master.startswith("local")
    check_columns(id_column, text_column)
    if not paths_checked:
        say_recovered(output_path, local_master)
    fmt = input_fmt if paths_checked else check_paths(
        input_path, output_path, fmt=input_fmt, overwrite=overwrite, local_master=local_master)
    wanted = {"--text-column": text_column} | ({} if id_column is None else {"--id-column": id_column})
    frame = read_input(spark, input_path, fmt, wanted, absent=ADDED_ID_COLUMN if id_column is None else None)
    id_added = id_column is None
    if id_column is None:
        id_column = ADDED_ID_COLUMN
        frame = frame.withColumn(id_column, F.monotonically_increasing_id())
        print(f"no --id-column: added {id_column!r} (Spark's monotonically_increasing_id: unique and increasing "
              "through the input as read, not consecutive)", file=sys.stderr)
    elif output_format(output_path) == "csv":
        check_csv_id(frame.select(quoted(id_column)).schema[0].dataType, id_column)
    # the two columns under names of this module's, so any input name works (dots, backticks, "answer", "error")
    kept = [F.col(quoted(id_column)).alias(ID), F.col(quoted(text_column)).alias(TEXT)]
    frame = frame.select(*kept, *([MALFORMED_ROW] if fmt == "csv" else []))
    started = time.perf_counter()
    rows_in = count_input(frame)  # before any repartitioning: Parquet answers it from the files' footers
    # Spark splits its input by bytes, but a Parquet row group goes whole to the split that holds its middle: a file
    # of one row group (pandas and pyarrow write up to a million rows in one) reaches a single task however many
    # splits it has, and a small file is one split. So the rows are always dealt out by count (a round-robin
    # shuffle, small next to the scoring it spreads): `--partitions`, else `default_partitions`.
    partitions = partitions or default_partitions(rows_in, task_slots(spark))
    frame = frame.repartition(partitions)

    ship_checks_by_value()
    model_udf = spark_model_udf(spark, model_uri, env_manager)
    staged = staged_output(output_path, local_master=local_master)  # None: written in place (hdfs://, s3a://)
    if staged is not None:
        staged.claim()
    written = output_path if staged is None else str(staged.folder)
    try:
        with progress_lines(spark, partitions):
            answers = scored_frame(frame, model_udf, max_chars, text_column).withColumnRenamed(ID, id_column)
            write_output(answers, written, overwrite and staged is None)
        counted = count_output(spark, written, None if id_added else id_column)
        rows_out, errors = counted.rows, counted.errors
        if counted.null_ids or counted.repeated_ids:
            print(f"warning: the id column {id_column!r} is null in {counted.null_ids} row(s) and repeats another "
                  f"row's id in {counted.repeated_ids}: their answers cannot be joined back to their rows by id",
                  file=sys.stderr)
        interruption_point()  # a signal that came during the count, which went on to its end
        seconds = time.perf_counter() - started
        summary = ScoringSummary(input=input_path, output=output_path, model_uri=model_uri,
                                 master=spark.sparkContext.master, id_column=id_column, id_added=id_added,
                                 partitions=partitions, rows_in=rows_in, rows_out=rows_out, scored=rows_out - errors,
                                 errors=errors, seconds=round(seconds, 3),
                                 rows_per_s=round(rows_in / seconds, 2) if seconds > 0 else 0.0)
        if rows_out != rows_in:
            left = "" if staged is None else f" ({output_path} is left as it was)"
            raise RowCountMismatch(f"the answers hold {rows_out} rows but {input_path} has {rows_in}: rows were lost "
                                   f"or duplicated{left}")
        if staged is not None:
            check_output(input_path, output_path, overwrite, local_master=local_master)  # what is there now
            staged.commit(overwrite)
    finally:
        if staged is not None:
            staged.discard()  # nothing to do once committed
    return summary


def default_model_uri(params_path: Path) -> tuple[str, int, str]:
    """The champion's URI (`models:/<name>@<alias>`), `package.max_chars_per_text` and the tracking store, from the
    params file (defaults where it is absent); MLflow is pointed at the params' tracking store
    (`$MLFLOW_TRACKING_URI` wins), once, for MLflow's Spark UDF, which takes no store of its own."""
    from pipeline.core.params import load_params_or_defaults
    from pipeline.core.parent_run import use_store

    params = load_params_or_defaults(params_path)
    store = use_store(params.mlflow)
    return (f"models:/{params.mlflow.registered_model_name}@{params.mlflow.champion_alias}",
            params.package.max_chars_per_text, store)


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def main(argv: list[str] | None = None) -> None:
    """Score the input; print the summary; exit 1 when the output's row count is not the input's, 130 or 143 when
    SIGINT or SIGTERM stopped the run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a Parquet or CSV file, or a folder of them (any Spark path)")
    parser.add_argument("--output", required=True, help="where the answers go: Parquet, or CSV if it ends in .csv")
    parser.add_argument("--model-uri", help="default: models:/<mlflow.registered_model_name>@<mlflow.champion_alias>")
    parser.add_argument("--id-column", help="the input's id column, copied to the output (default: add row_id)")
    parser.add_argument("--text-column", default="text", help="the column holding the reviews")
    parser.add_argument("--master", default="local[*]", help="Spark's master URL, passed unchanged")
    parser.add_argument("--format", choices=("auto", "parquet", "csv"), default="auto",
                        help="the input's format (auto: by the name, or the files in a folder)")
    parser.add_argument("--partitions", type=positive_int,
                        help="deal the rows into this many partitions (default: a multiple of the tasks Spark "
                             f"runs at once, at most {PARTITION_ROWS:,} rows each)")
    parser.add_argument("--task-threads", type=positive_int, default=1,
                        help="cores (and model threads) per task; cores / this many partitions score at once")
    parser.add_argument("--batch-rows", type=positive_int, default=BATCH_ROWS,
                        help="texts per predict call (Arrow batch)")
    parser.add_argument("--env-manager", default="local", choices=("local", "virtualenv", "uv", "conda"),
                        help="local: the executors' own Python; else MLflow rebuilds the model's environment")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="the registry entry (mlflow.*) and the text limit (package.max_chars_per_text)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output (only a folder an earlier run wrote)")
    parser.add_argument("--summary-json", type=Path, help="also write the summary here as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per model file, on every copy
    with stop_on_signals() as stops:
        try:
            summary = run(args, stops)
        except SystemExit:
            raise
        except BaseException as exc:
            raise exit_after(exc, signum=stops.received, output=args.output, master=args.master) from None
    print(f"scored {summary.input} with {summary.model_uri} on {summary.master} into {summary.output}: "
          f"{summary.rows_in} rows in, {summary.rows_out} out ({summary.scored} scored, {summary.errors} errors), "
          f"{summary.seconds:.1f} s, {summary.rows_per_s:.1f} rows/s ({summary.partitions} partitions; id column "
          f"{summary.id_column}{', added' if summary.id_added else ''})")
    if args.summary_json is not None:
        write_json(args.summary_json, asdict(summary))


def run(args: argparse.Namespace, stops: StopOnSignals) -> ScoringSummary:
    """The command's work: the checks that need no Spark (one line each, `SystemExit`), then the scoring, on a
    session of its own (stopped at the end) or the caller's running one (a notebook's, a test's; left running)."""
    from pipeline.core.params import ParamsError

    try:
        champion, max_chars, store = default_model_uri(args.params)
    except FileNotFoundError as exc:  # a --params that is not there
        raise SystemExit(str(exc)) from None
    except ParamsError as exc:
        raise SystemExit(f"{args.params}: {exc}") from None
    model_uri = args.model_uri or champion
    try:  # what can be checked before Spark starts (its start, the model's load and a pass over the input)
        check_columns(args.id_column, args.text_column)
        check_master(args.master)
        say_recovered(spark_path(args.output), args.master.startswith("local"))
        fmt = check_paths(spark_path(args.input), spark_path(args.output), fmt=args.format, overwrite=args.overwrite,
                          local_master=args.master.startswith("local"))
        check_task_threads(args.master, args.task_threads)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    check_model(model_uri, champion, store)
    batch_rows = arrow_batch_rows(args.batch_rows, max_chars)
    if batch_rows < args.batch_rows:
        print(f"--batch-rows {args.batch_rows} cut to {batch_rows}: an Arrow batch of texts of up to {max_chars} "
              f"characters stays within {ARROW_BATCH_BYTES // 2**20} MiB", file=sys.stderr)
    with session_for(args.master, args.task_threads, batch_rows) as spark:
        stops.install()  # again: SparkContext's start put its own SIGINT handler in place
        return score(spark, args.input, args.output, model_uri, id_column=args.id_column,
                     text_column=args.text_column, max_chars=max_chars, input_fmt=fmt, partitions=args.partitions,
                     env_manager=args.env_manager, overwrite=args.overwrite, paths_checked=True)


def say_recovered(output_path: str, local_master: bool) -> None:
    """`recover_abandoned` beside the output, before it is checked, each thing done said on stderr."""
    for line in recover_abandoned(output_path, local_master=local_master):
        print(line, file=sys.stderr)


def exit_after(exc: BaseException, *, signum: int | None, output: str, master: str) -> BaseException:
    """What the command ends with after `exc`: after a stop signal, one line and 128 + its number, whatever the error
    it caused on the way (a cancelled job's); a refused input or a wrong row count, one line and 1; any other error
    of Spark's, its first meaningful line and 1 (`spark_error_exit`). Anything else is returned as it is, its
    traceback shown (a fault of this code's). A staging folder left by Spark's last tasks, which can outlive the job
    a signal cancelled, is deleted again once the session stopped."""
    staged = staged_output(spark_path(output), local_master=master.startswith("local"))
    if staged is not None:
        staged.discard()
    if signum is not None:
        left = (f"{output} is left as it was" if staged is not None else
                f"{output} may hold part of the answers (a complete output holds _SUCCESS)")
        print(f"interrupted by {signal.Signals(signum).name}: scoring stopped; {left}", file=sys.stderr)
        return SystemExit(128 + signum)
    if isinstance(exc, (RowCountMismatch, ValueError)):
        print(f"error: {exc}", file=sys.stderr)
        return SystemExit(1)
    return spark_error_exit(exc) or exc


if __name__ == "__main__":
    main()
