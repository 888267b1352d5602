"""Unit: batch scoring on Apache Spark (`pipeline.deployment.batch_scoring`), in local mode with one Spark session
for the module, the tiny model logged as the project logs every variant (a `ContractPredictor` pyfunc), real IMDB
reviews and every kind of bad row. Every answer must be the one the same pyfunc gives that review scored alone in
this process, every bad row must come out with the contract's error and no label, and no row may be lost."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import ipaddress
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline.core.params import MlflowParams, PackageParams
from pipeline.deployment import batch_inputs, batch_rows, batch_scoring, csv_text, spark_io
from pipeline.deployment.protocol import RequestError, check_text
from tests.unit.deployment.test_csv_text import CASES

MAX_CHARS = PackageParams().max_chars_per_text
#: Rows the contract refuses (text column of strings): what each one's error must say.
BAD_TEXTS = {
    "null": (None, "must be a string, got null"),
    "empty": ("", "empty or whitespace only"),
    "blank": ("   \t ", "empty or whitespace only"),
    "invisible": ("\u200b\u202e\u2066", "no visible character"),
    "replacement characters": ("\ufffd\ufffd", "no visible character"),
    "markup only": ("<br /><br />", "line-break markup"),
    "over-long": ("x" * (MAX_CHARS + 1), f"more than the limit of {MAX_CHARS}"),
}


def test_the_row_check_is_the_contracts_check_text():
    """No Spark: the per-batch check answers what `check_text` (with the text limit) raises, None for a review."""
    values = pd.Series(["a fine film", None, math.nan, "  ", "\u200b", "y" * 13, "y" * 12, "42"])
    got = batch_rows.text_errors(values, "text", 12).tolist()
    for value, error in zip(values, got, strict=True):
        try:
            check_text(value, "text", 12)
            assert error is None, value
        except RequestError as exc:
            assert error == exc.message
    assert got[0] is None and got[-1] is None and got[5].endswith("more than the limit of 12")


@pytest.mark.parametrize("path, fmt", [("a.csv", "csv"), ("a.CSV/", "csv"), ("a.parquet", "parquet"),
                                       ("b.pq", "parquet"), ("s3a://bucket/reviews/", "parquet")])
def test_the_format_follows_the_name(path, fmt):
    assert batch_inputs.input_format(path) == fmt
    assert batch_inputs.input_format(path, "csv") == "csv"


def test_local_paths_reach_spark_absolute_and_uris_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert spark_io.spark_path("out/scored.csv") == str(tmp_path / "out" / "scored.csv")
    for uri in ("s3a://bucket/reviews/", "hdfs://nn:8020/x.parquet", "file:///tmp/x.csv"):
        assert spark_io.spark_path(uri) == uri


def test_a_folder_of_csv_files_is_read_as_csv(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part-1.csv").write_text("text\nfine\n")
    assert batch_inputs.input_format(str(tmp_path / "in")) == "csv"
    assert spark_io.output_format(str(tmp_path / "scored.csv")) == "csv"
    assert spark_io.output_format(str(tmp_path / "scored")) == "parquet"


@pytest.fixture(scope="module")
def spark():
    """One session for the module. Stopping it must put back the SIGINT handler SparkContext replaced."""
    before = signal.getsignal(signal.SIGINT)
    with spark_io.session_for("local[2]", task_threads=1, shuffle_partitions=2) as session:
        assert signal.getsignal(signal.SIGINT) is not before  # pyspark's own while the context runs
        yield session
    assert signal.getsignal(signal.SIGINT) is before, "the SIGINT handler from before the session was not put back"


@pytest.fixture(scope="module")
def model(tmp_path_factory, built, tracking_store):
    """The tiny model's int8-dynamic variant (ONNX Runtime, as the default run's champion often is) logged as the
    evaluate stage logs a variant (`log_variant_model`: a `ContractPredictor` pyfunc, one thread) and registered
    as imdb-sentiment@champion in a store of its own. Spark's Python workers load it without torch or transformers
    (`pipeline.data.saved_tokenizer`)."""
    import mlflow

    from pipeline.core.parent_run import start_tracking
    from pipeline.core.tracking import stage_run
    from pipeline.deployment.mlflow_model import log_variant_model

    work = tmp_path_factory.mktemp("batch-scoring-model")
    store = MlflowParams(tracking_uri=tracking_store(work / "mlflow.db"), experiment="unit")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        # mlflow.set_tracking_uri also exports the store as MLFLOW_TRACKING_URI: set here, it is removed on leaving
        mp.setenv("MLFLOW_TRACKING_URI", store.tracking_uri)
        with stage_run(start_tracking(store, run_id="unit-batch-scoring"), "evaluate", run_name="int8-dynamic") as run:
            ref = log_variant_model(run, "int8-dynamic", built["dirs"]["int8-dynamic"], PackageParams(threads=1), {})
        version = mlflow.register_model(ref.uri, "imdb-sentiment")
        mlflow.MlflowClient().set_registered_model_alias("imdb-sentiment", "champion", version.version)
    return {"uri": ref.uri, "store": store, "work": work}


@pytest.fixture
def in_store(model, monkeypatch):
    """MLflow pointed at the model's store for one test, as the command does (`default_model_uri`)."""
    from pipeline.core.parent_run import use_store

    monkeypatch.chdir(model["work"])
    use_store(model["store"])
    return model


def alone(model_uri: str, texts: list[str]) -> pd.DataFrame:
    """Each text scored alone by the same pyfunc, loaded in this process."""
    import mlflow

    pyfunc = mlflow.pyfunc.load_model(model_uri)
    return pd.concat([pyfunc.predict(pd.DataFrame({"text": [t]})) for t in texts], ignore_index=True)


@pytest.mark.parametrize("rows, slots, want", [(0, 2, 2), (30, 2, 2), (20_000, 2, 2), (20_001, 2, 4),
                                               (2_000_000, 64, 256), (5, 0, 1)])
def test_rows_are_dealt_into_a_multiple_of_the_task_slots_of_at_most_partition_rows_each(rows, slots, want):
    assert batch_scoring.PARTITION_ROWS == 10_000
    assert batch_scoring.default_partitions(rows, slots) == want


def test_a_local_sessions_driver_jvm_compiles_with_c1_only(spark):
    """In local mode the driver JVM is started here, with C1 only (`LOCAL_DRIVER_JAVA_OPTIONS`): its C2 compiler
    threads took CPU from the model's Python workers. Its log configuration (`LOCAL_LOG_CONFIG`) goes with them."""
    runtime = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    assert set(spark_io.LOCAL_DRIVER_JAVA_OPTIONS.split()) <= set(runtime.getInputArguments())
    assert set(spark_io.local_driver_java_options().split()) <= set(runtime.getInputArguments())


def listening_addresses(pid: int) -> set[str]:
    """The addresses the process `pid` listens on for TCP connections, read from /proc (its sockets' inodes, then
    the LISTEN rows of its network namespace's tcp and tcp6 tables)."""
    import socket

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():  # no IPv6 in this kernel
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, one of the process's sockets
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
                found.add(socket.inet_ntop(family, words))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_a_local_session_listens_on_loopback_only_and_its_ui_kills_no_job(spark):
    """A local job's driver listened on every interface (its web UI on *:4040, its RPC endpoint and block manager
    on the host's address), and the UI, which asks for no credentials, could kill its jobs: now every port is on
    loopback (`SPARK_LOCAL_IP`) and the UI's kill links are off."""
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    addresses = listening_addresses(pid)
    assert addresses, "the driver listens nowhere: the check above could not fail"
    assert all(is_loopback(a) for a in addresses), addresses
    assert spark.sparkContext.getConf().get("spark.ui.killEnabled") == "false"


def test_a_one_row_group_file_read_in_many_splits_is_scored_by_every_slot(spark, in_store, tmp_path):
    """Spark splits a file by bytes and gives a Parquet row group to one split whole: the rows must still be dealt
    to every slot (before, a file in more splits than slots kept its splits, and one task scored every row)."""
    texts = [f"review {i}: {'a fine film' if i % 2 else 'a dull film'}, " * 3 for i in range(40)]
    path = tmp_path / "one-group.parquet"
    pd.DataFrame({"review_id": range(len(texts)), "text": texts}).to_parquet(path, row_group_size=len(texts))
    before = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "512")  # many byte splits of the one row group
    try:
        assert spark.read.parquet(str(path)).rdd.getNumPartitions() > 2
        summary = batch_scoring.score(spark, str(path), str(tmp_path / "out"), in_store["uri"],
                                      id_column="review_id", max_chars=MAX_CHARS)
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", before)
    per_file = [len(pd.read_parquet(part)) for part in sorted((tmp_path / "out").glob("part-*.parquet"))]
    assert summary.partitions == 2 and summary.rows_out == len(texts)
    assert sorted(n for n in per_file if n) == [len(texts) // 2] * 2  # dealt evenly, not 40 in one task


def assert_same_answers(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert got["label"].tolist() == want["label"].tolist()
    assert np.allclose(got["score"].astype(float), want["score"].astype(float), rtol=0, atol=1e-4)


def test_a_parquet_of_reviews_and_bad_rows_comes_out_whole_with_errors_beside_the_answers(spark, in_store, imdb_dir,
                                                                                           tmp_path):
    reviews = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].iloc[::997].tolist()[:24]
    good = [*reviews, "42", "y " * (MAX_CHARS // 2)]  # a number written as text is a review; so is one at the limit
    texts = good + [text for text, _ in BAD_TEXTS.values()]
    ids = [f"r{i:03d}" for i in range(len(texts))]
    pd.DataFrame({"review_id": ids, "text": pd.Series(texts, dtype=object)}).to_parquet(tmp_path / "in.parquet")

    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out"), in_store["uri"],
                                  id_column="review_id", max_chars=MAX_CHARS)

    out = pd.read_parquet(tmp_path / "out").set_index("review_id").loc[ids]  # KeyError if one went missing
    assert summary.rows_in == summary.rows_out == len(out) == len(texts) and out.index.is_unique
    assert (summary.scored, summary.errors) == (len(good), len(BAD_TEXTS)) and not summary.id_added
    assert summary.partitions == 2  # one small file, spread over both cores
    scored = out.iloc[: len(good)]
    assert scored["error"].isna().all()
    assert_same_answers(scored.reset_index(), alone(in_store["uri"], good))
    refused = out.iloc[len(good):]
    assert refused["label"].isna().all() and refused["score"].isna().all()
    for (name, (_, needle)), error in zip(BAD_TEXTS.items(), refused["error"], strict=True):
        assert error.startswith("text ") and needle in error, name


def test_a_text_column_of_numbers_is_refused_row_by_row_and_no_row_is_lost(spark, in_store, tmp_path):
    pd.DataFrame({"text": pd.array([42, None, 7], dtype="Int64")}).to_parquet(tmp_path / "numbers.parquet")
    summary = batch_scoring.score(spark, str(tmp_path / "numbers.parquet"), str(tmp_path / "out"), in_store["uri"],
                                  max_chars=MAX_CHARS)
    out = pd.read_parquet(tmp_path / "out").sort_values("row_id")
    assert summary.id_added and summary.id_column == "row_id" and out["row_id"].is_unique
    assert (summary.rows_in, summary.rows_out, summary.errors, summary.scored) == (3, 3, 3, 0)
    assert out["label"].isna().all() and out["score"].isna().all()
    assert sorted(out["error"]) == ["text must be a string, got a number"] * 2 + ["text must be a string, got null"]


def test_an_output_with_another_row_count_than_the_input_fails_the_job(spark, in_store, tmp_path, monkeypatch):
    # a column the model never sees (no Python worker has to load it), so the job is quick
    pd.DataFrame({"text": pd.array([1, None], dtype="Int64")}).to_parquet(tmp_path / "in.parquet")
    monkeypatch.setattr(batch_scoring, "count_output",  # as if a row were lost
                        lambda spark, path, ids: spark_io.Written(rows=1, errors=1))
    with pytest.raises(batch_scoring.RowCountMismatch, match=r"hold 1 rows but .* has 2"):
        batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out"), in_store["uri"],
                            max_chars=MAX_CHARS)


def test_the_command_scores_a_csv_with_the_champion_into_a_csv(spark, model, tmp_path, monkeypatch, capsys):
    """`python -m pipeline.deployment.batch_scoring` end to end (in this process, on the module's session): the
    champion from params' store, a CSV with quoted commas, line breaks and doubled quotes (in a review and in an
    id), an empty field (null)."""
    texts = ['Great, "moving" film.\nWould watch again.', "42", None, "   ", "dull and far too long"]
    csv = tmp_path / "reviews.csv"
    ids = ["r10", "r\n11", "r12", "r13", "r14"]  # an id the writer quotes across lines is still one row read back
    pd.DataFrame({"id": ids, "text": texts}).to_csv(csv, index=False)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": model["store"].tracking_uri}}))
    monkeypatch.chdir(tmp_path)

    batch_scoring.main(["--input", str(csv), "--output", "scored.csv", "--id-column", "id", "--params", "params.yaml",
                        "--summary-json", "summary.json"])

    assert "5 rows in, 5 out (3 scored, 2 errors)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model_uri"] == "models:/imdb-sentiment@champion" and summary["rows_out"] == 5
    parts = sorted((tmp_path / "scored.csv").glob("part-*.csv"))
    out = pd.concat([pd.read_csv(p) for p in parts]).set_index("id").loc[ids]
    assert out["error"].iloc[:2].isna().all() and out["error"].iloc[4:].isna().all()
    assert_same_answers(out.iloc[[0, 1, 4]].reset_index(), alone(model["uri"], [texts[0], "42", texts[4]]))
    assert out["error"].iloc[2] == "text must be a string, got null" and "whitespace" in out["error"].iloc[3]
    assert out["label"].iloc[2:4].isna().all()

    with pytest.raises(SystemExit) as refused:  # a column the input lacks: one line naming it, before any scoring
        batch_scoring.main(["--input", str(csv), "--output", "again.csv", "--text-column", "body"])
    assert refused.value.code == 1 and "has no column 'body'" in capsys.readouterr().err
    assert not (tmp_path / "again.csv").exists()


def test_an_output_that_would_destroy_data_is_refused_before_spark_starts(tmp_path):
    """Spark's overwrite deletes the output first: never the input, a folder holding it, or files it did not write."""
    reviews = tmp_path / "in" / "reviews.csv"
    reviews.parent.mkdir()
    reviews.write_text("text\nfine\n")
    check = batch_inputs.check_output
    for out in (reviews, reviews.parent, tmp_path, reviews.parent / "scored"):  # itself, above it, inside its folder
        with pytest.raises(ValueError, match="is the input, holds it or lies inside it"):
            check(str(reviews.parent if out == reviews.parent / "scored" else reviews), str(out), True)
    with pytest.raises(ValueError, match="is the input"):
        check("s3a://bucket/reviews/", "s3a://bucket/reviews", True)
    check(str(reviews), str(tmp_path / "new.csv"), False)  # not there yet: fine

    earlier = tmp_path / "scored"
    earlier.mkdir()
    for name in ("part-00000-x.snappy.parquet", ".part-00000-x.snappy.parquet.crc", "_SUCCESS"):
        (earlier / name).write_text("")
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        check(str(reviews), str(earlier), False)
    check(str(reviews), str(earlier), True)  # an earlier output: replaced
    (tmp_path / "empty").mkdir()
    check(str(reviews), str(tmp_path / "empty"), True)

    mine = tmp_path / "mine"
    (mine / "keep").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds keep, notes\.txt, which Spark did not write"):
        check(str(reviews), str(mine), True)
    (tmp_path / "a-file.csv").write_text("x")
    with pytest.raises(ValueError, match="not a folder Spark wrote"):
        check(str(reviews), str(tmp_path / "a-file.csv"), True)
    assert (mine / "notes.txt").read_text() == "mine" and reviews.read_text() == "text\nfine\n"


def test_a_folder_is_read_as_the_one_format_its_own_files_have(tmp_path):
    mixed, nested, partitioned = tmp_path / "mixed", tmp_path / "nested", tmp_path / "partitioned"
    for folder in (mixed, nested / "sub", partitioned / "year=2024"):
        folder.mkdir(parents=True)
    (mixed / "a.csv").write_text("text\nfine\n")
    (mixed / "README.txt").write_text("not data\n")
    assert batch_inputs.input_format(str(mixed)) == "csv"  # the README is skipped when read (`read_input`)
    pd.DataFrame({"text": ["fine"]}).to_parquet(mixed / "b.parquet")
    with pytest.raises(ValueError, match="both CSV and Parquet"):
        batch_inputs.input_format(str(mixed))
    assert batch_inputs.input_format(str(mixed), "parquet") == "parquet"
    (nested / "sub" / "a.csv").write_text("text\nfine\n")
    with pytest.raises(ValueError, match=r"no \.csv or \.parquet file directly in it"):
        batch_inputs.input_format(str(nested))
    pd.DataFrame({"text": ["fine"]}).to_parquet(partitioned / "year=2024" / "part-0.parquet")
    assert batch_inputs.input_format(str(partitioned)) == "parquet"


def test_an_input_spark_would_misread_is_refused_with_the_reason(tmp_path):
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("id,text\nr1,café très bien\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv is not UTF-8 \(byte 14: "):
        batch_inputs.check_input(str(latin1), "csv")
    with pytest.raises(ValueError, match=r"is not UTF-8 \(byte 2100000"):  # found past the first chunk too
        big = tmp_path / "big.csv"
        big.write_bytes(b"text\n" + b"a fine film\n" * 174_999 + b"x" * 7 + b"\xe9\n")
        csv_text.check_csv_text(big, chunk_bytes=1 << 16)
    pq = tmp_path / "reviews.parquet"
    pd.DataFrame({"text": ["fine"]}).to_parquet(pq)
    with pytest.raises(ValueError, match="is a Parquet file, but is read as csv: pass --format parquet"):
        batch_inputs.check_input(str(pq), "csv")
    with pytest.raises(ValueError, match="is not a Parquet file, but is read as parquet: pass --format csv"):
        batch_inputs.check_input(str(latin1), "parquet")
    with pytest.raises(ValueError, match="does not exist"):
        batch_inputs.check_input(str(tmp_path / "nowhere.csv"), "csv")
    batch_inputs.check_input(str(pq), "parquet")
    batch_inputs.check_input("s3a://bucket/reviews/", "parquet")  # another file system: Spark's to check


def test_arguments_spark_would_fail_on_late_are_refused_first():
    with pytest.raises(ValueError, match="more than the 2 core"):
        batch_inputs.check_task_threads("local[2]", 3)
    with pytest.raises(ValueError, match="more than the 1 core"):
        batch_inputs.check_task_threads("local", 2)
    batch_inputs.check_task_threads("local[4, 2]", 4)
    batch_inputs.check_task_threads("spark://head:7077", 64)  # a cluster's cores are its own
    for name in ("label", "score", "error"):
        with pytest.raises(ValueError, match="name of an output column"):
            batch_inputs.check_columns(name, "text")
    batch_inputs.check_columns("answer", "review.text")
    with pytest.raises(SystemExit):
        batch_scoring.main(["--input", "x.csv", "--output", "y", "--partitions", "0"])


def test_malformed_rows_dotted_names_and_padded_ids_come_out_whole(spark, in_store, tmp_path):
    """A row an unquoted comma split (or one missing a field) is answered with an error, not scored from what
    Spark kept of it; a text column named with a dot and an id column named like the job's internals work; ids
    keep their spaces in a CSV output."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "reviews.csv").write_text('answer,review.text\nr1,great film, loved the cast\n r2 ,"a dull, slow film"\n'
                                        'r3\nr4,"a fine film"\n')
    (folder / "README.txt").write_text("answer,review.text\nnot,data\n")
    with gzip.open(folder / "more.csv.gz", "wt", encoding="utf-8") as f:  # compressed, as Spark writes CSV parts
        f.write("answer,review.text\nr5,a fine film\n")
    summary = batch_scoring.score(spark, str(folder), str(tmp_path / "out.csv"), in_store["uri"], max_chars=MAX_CHARS,
                                  id_column="answer", text_column="review.text")
    assert (summary.rows_in, summary.rows_out, summary.errors) == (5, 5, 2)
    parts = sorted((tmp_path / "out.csv").glob("part-*.csv"))
    out = pd.concat([pd.read_csv(p, dtype=str, keep_default_na=False) for p in parts]).set_index("answer")
    assert sorted(out.index) == [" r2 ", "r1", "r3", "r4", "r5"]
    assert out.loc["r5", "label"] == out.loc["r4", "label"]
    assert out.loc["r1", "error"] == out.loc["r3", "error"] == batch_rows.MALFORMED_MESSAGE
    assert out.loc["r1", "label"] == "" and out.loc[" r2 ", "error"] == "" and out.loc["r4", "label"] != ""
    assert_same_answers(out.loc[[" r2 ", "r4"]].reset_index(), alone(in_store["uri"], ["a dull, slow film",
                                                                                        "a fine film"]))


def test_spark_reads_an_open_quote_as_the_rest_of_the_file(spark, tmp_path):
    """Why `csv_text` refuses an open quote before Spark starts: Spark reads the rows below it as one review's text
    (no malformed row, no error), and reads every file the check lets through as the rows a CSV reader finds."""
    for i, (text, line) in enumerate(CASES.values()):
        path = tmp_path / f"case{i}.csv"
        path.write_text(text, newline="")
        got = spark_io.read_input(spark, spark_io.spark_path(str(path)), "csv").collect()
        if line is None:
            assert len(got) == len(list(csv.reader(io.StringIO(text, newline="")))) - 1, text
        elif text.startswith("id,text\nr1,\"abc"):
            assert [(r["id"], r["text"]) for r in got] == [("r1", "abc\nr2,def\nr3,ghi\n")]


def test_the_command_says_what_is_wrong_in_one_line_before_spark_starts(model, tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": model["store"].tracking_uri}}))
    (tmp_path / "in.csv").write_text("text\na fine film\n")
    (tmp_path / "scored").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spark_io, "spark_session", lambda *a, **k: pytest.fail("Spark started"))
    base = ["--input", "in.csv", "--params", "params.yaml"]
    for extra, message in ((["--output", "scored"], "scored exists: pass --overwrite"),
                           (["--output", "in.csv", "--overwrite"], "is the input"),
                           (["--output", "new", "--model-uri", "models:/nope@x"], "models:/nope@x cannot be read"),
                           (["--output", "new", "--id-column", "score"], "name of an output column")):
        with pytest.raises(SystemExit) as stopped:
            batch_scoring.main(base + extra)
        assert message in str(stopped.value.code)
    (tmp_path / "bad.yaml").write_text("mlflow: {tracking_uri: 5, nope: 1}\n")
    with pytest.raises(SystemExit, match=r"bad\.yaml"):
        batch_scoring.main(["--input", "in.csv", "--output", "new", "--params", "bad.yaml"])


def test_what_the_checks_cannot_see_on_disk_is_left_to_spark_and_compared_by_name(tmp_path):
    """Globs, other file systems and a cluster's plain paths are not looked up locally; output and input on them
    are still compared by name, and an output holding the input is refused there too."""
    for inp, out in (("hdfs://nn/data/in/r.parquet", "hdfs://nn/data"), ("s3a://b/data/in/", "s3a://b//data/"),
                     ("s3a://b/data", "s3a://b/data/in/scored"), ("/data/in", "/data")):
        with pytest.raises(ValueError, match="is the input, holds it or lies inside it"):
            batch_inputs.check_output(inp, out, True, local_master=False)
    batch_inputs.check_output("s3a://b/data/in", "s3a://b/data/out", True)
    batch_inputs.check_input(str(tmp_path / "g" / "*.parquet"), "parquet")  # Spark expands the glob itself
    batch_inputs.check_input("/nowhere/reviews.parquet", "parquet", local_master=False)  # the cluster's file system
    assert batch_inputs.local_path("file:///d/p%20q#x") == Path("/d/p%20q#x")  # as Hadoop reads it: no unquoting
    assert batch_inputs.local_path("file://host/d/x") == Path("/d/x")


def test_symlinks_staging_and_other_spellings_of_the_input_are_caught(tmp_path):
    reviews = tmp_path / "in"
    reviews.mkdir()
    pd.DataFrame({"text": ["fine"]}).to_parquet(reviews / "part-0.parquet")
    (tmp_path / "alias").symlink_to(reviews)
    with pytest.raises(ValueError, match="is the input"):
        batch_inputs.check_output(str(reviews), str(tmp_path / "alias"), True)
    earlier = tmp_path / "earlier"
    (earlier / "_temporary" / "0").mkdir(parents=True)  # a killed job's staging: still Spark's own output
    (earlier / "part-00000-x.parquet").write_text("")
    batch_inputs.check_output(str(reviews), str(earlier), True)
    (tmp_path / "link").symlink_to(earlier)
    with pytest.raises(ValueError, match="not a folder Spark wrote"):
        batch_inputs.check_output(str(reviews), str(tmp_path / "link"), True)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        batch_inputs.check_output(str(reviews), str(tmp_path / "dangling"), False)


def test_compressed_partitioned_and_suffixless_inputs_are_read_as_spark_reads_them(tmp_path):
    gz = tmp_path / "one.csv.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("text\na fine film\n")
    assert batch_inputs.input_format(str(gz)) == "csv"
    batch_inputs.check_input(str(gz), "csv")
    bad = tmp_path / "latin1.csv.gz"
    with gzip.open(bad, "wb") as f:
        f.write("text\ncafé\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 \(byte 8"):
        batch_inputs.check_input(str(bad), "csv")
    partitioned = tmp_path / "by-year"
    (partitioned / "year=2024").mkdir(parents=True)
    (partitioned / "year=2024" / "part-0.csv").write_text("text\nfine\n")
    assert batch_inputs.input_format(str(partitioned)) == "csv"
    hive = tmp_path / "hive"
    hive.mkdir()
    pd.DataFrame({"text": ["fine"]}).to_parquet(hive / "000000_0")
    with pytest.raises(ValueError, match="pass --format"):
        batch_inputs.input_format(str(hive))
    batch_inputs.check_input(str(hive), "parquet")  # with --format parquet: every file read, each checked
    assert batch_inputs.files_to_read(hive, "parquet") is None


def test_a_folders_file_named_like_a_pattern_is_read_as_itself(spark, tmp_path):
    """The files of a folder are given to Spark one by one (a README beside them is skipped): one named
    `rev[1].parquet` was read as the pattern, so `rev1.parquet` was read twice and it never."""
    pd.DataFrame({"id": ["literal"], "text": ["the one named"]}).to_parquet(tmp_path / "rev[1].parquet")
    pd.DataFrame({"id": ["other"], "text": ["another"]}).to_parquet(tmp_path / "rev1.parquet")
    got = spark_io.read_input(spark, str(tmp_path), "parquet").collect()
    assert sorted(row["id"] for row in got) == ["literal", "other"]


def earlier_output(folder: Path) -> dict[str, bytes]:
    """An earlier run's output at `folder` (a part file and `_SUCCESS`), as its files' contents by name."""
    folder.mkdir(parents=True)
    pd.DataFrame({"row_id": [7], "label": ["positive"], "score": [0.9], "error": [None]}).to_parquet(
        folder / "part-00000-earlier.parquet")
    (folder / "_SUCCESS").write_text("")
    return {f.name: f.read_bytes() for f in folder.iterdir()}


def test_a_run_that_fails_after_writing_leaves_the_output_as_it_was(spark, in_store, tmp_path, monkeypatch):
    """Spark writes a hidden folder beside OUTPUT, renamed onto it once counted: a run stopped after its write (here
    its count fails) left a folder of part files without `_SUCCESS`, which pandas reads as fewer rows, or had already
    deleted the earlier output `--overwrite` replaces."""
    pd.DataFrame({"text": pd.array([1, None], dtype="Int64")}).to_parquet(tmp_path / "in.parquet")

    def killed(spark, path, ids):
        assert re.fullmatch(r"\.(new|earlier)\.scoring-.+-\d+", Path(path).parent.name)
        assert (Path(path) / "_SUCCESS").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_scoring, "count_output", killed)
    before = earlier_output(tmp_path / "earlier")
    for out, overwrite in (("new", False), ("earlier", True)):
        with pytest.raises(KeyboardInterrupt):
            batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / out), in_store["uri"],
                                max_chars=MAX_CHARS, overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "in.parquet"]  # no OUTPUT, no staging left
    assert {f.name: f.read_bytes() for f in (tmp_path / "earlier").iterdir()} == before

    monkeypatch.undo()
    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "earlier"), in_store["uri"],
                                  max_chars=MAX_CHARS, overwrite=True)
    assert summary.rows_out == 2 and len(pd.read_parquet(tmp_path / "earlier")) == 2  # replaced, once counted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "in.parquet"]


#: SIGINT replaces pyspark's own handler; SIGTERM's way through the same handler is checked without Spark in
#: tests/unit/deployment/test_batch_failures.py, and here under `make test-all` (a whole command costs half a minute).
@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_during_the_write_stops_the_run_with_one_line_and_the_shells_status(model, imdb_dir, tmp_path,
                                                                                     signum):
    """SIGINT exited 1 with a Py4J traceback (pyspark's handler calls the JVM from inside a call to it) and left a
    partial output; SIGTERM killed the run where it stood. Now: Spark's jobs cancelled, exit 128 + the signal, one
    line, OUTPUT as it was (here an earlier output `--overwrite` would have replaced), no staging folder left. The
    command runs in a process of its own, as a user's shell runs it, and gets the signal there (sent to the test's
    own process, a stray one could end the test worker instead of failing the test)."""
    import subprocess
    import sys

    from tests.factories import ROOT

    texts = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].iloc[:400]
    texts.to_frame().to_parquet(tmp_path / "in.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": model["store"].tracking_uri}}))
    before = earlier_output(tmp_path / "out")
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.deployment.batch_scoring", "--input", "in.parquet",
                             "--output", "out", "--overwrite", "--params", "params.yaml"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = False
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if any(tmp_path.glob(".out.scoring-*/out/_temporary")):  # Spark is writing the answers
            proc.send_signal(signum)
            sent = True
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=300)
    assert sent, f"the run ended before its write was seen (exit {proc.returncode}): {err[-2000:]}"
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"interrupted by {signal.Signals(signum).name}: scoring stopped; out is left as it was" in err
    assert "Traceback" not in err
    assert "native-hadoop" not in err and 'env_manager="local"' not in err  # two warnings of every start, left out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "out", "params.yaml"]
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before


def undecodable_parquet(path: Path, texts: list[bytes]) -> None:
    """A Parquet file whose string column `text` holds these bytes as they are, valid UTF-8 or not (pyarrow checks
    nothing when it views binary as string), with ids r0, r1, ..."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(texts, pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": column}), path)


def test_spark_sql_refuses_over_long_and_undecodable_texts_before_python_sees_them(spark, tmp_path):
    """A text over the limit reached the pandas UDF inside an Arrow batch of 2,048 rows with no cap on bytes:
    4,001 texts of 150 KB ran the JVM out of direct memory and the job hung. One not valid UTF-8 failed the whole
    job (the Python worker could not decode it). Spark SQL now refuses both and hands on a null in their place;
    the over-long text's message is the contract's, characters counted as Python counts them."""
    texts = {"fine": "a fine film", "long": "y" * 5_000, "wide": "\U0001f600" * 51, "at the limit": "\U0001f600" * 50}
    undecodable_parquet(tmp_path / "in.parquet", [t.encode() for t in texts.values()] + [b"caf\xe9", b"\xed\xa0\x80"])
    frame = spark.read.parquet(str(tmp_path / "in.parquet"))
    text, error = batch_rows.checked_text(frame, "text", 50, "text")
    got = {row["id"]: (row["handed_on"], row["error"]) for row in
           frame.select("id", text.alias("handed_on"), error.alias("error")).collect()}

    def contract(value: str) -> str:
        with pytest.raises(RequestError) as refused:
            check_text(value, "text", 50)
        return refused.value.message

    assert got["r0"] == ("a fine film", None) and got["r3"] == (texts["at the limit"], None)
    assert got["r1"] == (None, contract(texts["long"])) and got["r2"] == (None, contract(texts["wide"]))
    assert got["r4"] == got["r5"] == (None, "text is not valid UTF-8")


def test_a_text_that_is_not_utf8_is_refused_alone_and_the_others_are_scored(spark, in_store, tmp_path):
    undecodable_parquet(tmp_path / "in.parquet", [b"a fine film", b"caf\xe9 cr\xe8me", b"a dull film"])
    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out"), in_store["uri"],
                                  id_column="id", max_chars=MAX_CHARS)
    out = pd.read_parquet(tmp_path / "out").set_index("id").sort_index()
    assert (summary.rows_out, summary.scored, summary.errors) == (3, 2, 1)
    assert out.loc["r1", "error"] == "text is not valid UTF-8" and pd.isna(out.loc["r1", "label"])
    assert_same_answers(out.loc[["r0", "r2"]].reset_index(), alone(in_store["uri"], ["a fine film", "a dull film"]))


@pytest.mark.parametrize("rows, max_chars, want", [(2048, 20_000, 2048), (2048, 1_000_000, 67),
                                                    (100_000, 20_000, 3355), (5, 10**12, 1)])
def test_an_arrow_batch_holds_at_most_256_mib_of_the_longest_texts(rows, max_chars, want):
    assert batch_rows.arrow_batch_rows(rows, max_chars) == want


def test_csv_files_whose_headers_order_the_columns_differently_are_refused_not_swapped(spark, tmp_path):
    """Spark named the columns from one file's header and read every file by position: b.csv's ids came out as
    texts and its texts as ids, with exit 0. Every header is checked now, before the model loads."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_text("text,id\nA wonderful film,a1\n")
    (folder / "b.csv").write_text("id,text\nb1,Dull and far too long\n")
    with pytest.raises(ValueError, match=r"^the CSV files' headers differ: file:\S+/[ab]\.csv has (id, text|text, id), "
                                         r"another (text, id|id, text) \(Spark would read"):
        batch_scoring.score(spark, str(folder), str(tmp_path / "out"), "models:/never-loaded", id_column="id",
                            max_chars=MAX_CHARS)
    assert not (tmp_path / "out").exists()
    (folder / "b.csv").write_text("text,id\nDull and far too long,b1\n")  # the same order: read as before
    frame = spark_io.read_input(spark, str(folder), "csv")
    assert spark_io.count_input(frame) == 2
    assert sorted((r["id"], r["text"]) for r in frame.collect()) == [("a1", "A wonderful film"),
                                                                     ("b1", "Dull and far too long")]


def test_only_the_text_and_id_columns_are_read_so_no_other_column_can_fail_the_job(spark, tmp_path):
    """Spark inferred the schema from every column and failed on ones it cannot read (pyarrow's default
    timestamp[ns], time64) or tell apart (`note`, `NOTE`), and took a Parquet column named `_malformed_row` for its
    own mark of a malformed CSV row. Now only the wanted columns are read; a float16 column, which Spark cannot
    read even unasked, and a wanted name held twice are one line each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"text": pa.array(["a fine film", "a dull film"]), "id": pa.array([1, 2]),
               "ts": pa.array([1, 2], pa.timestamp("ns")), "at": pa.array([1, 2], pa.time64("ns")),
               "note": pa.array(["a", "b"]), "NOTE": pa.array(["c", "d"]), "_malformed_row": pa.array(["x", None])}
    pq.write_table(pa.table(list(columns.values()), names=list(columns)), tmp_path / "wide.parquet")
    wanted = {"--text-column": "Text", "--id-column": "id"}  # names match ignoring case, as Spark matches them
    frame = spark_io.read_input(spark, str(tmp_path / "wide.parquet"), "parquet", wanted)
    assert frame.columns == ["text", "id"]
    assert sorted(tuple(row) for row in frame.collect()) == [("a dull film", 2), ("a fine film", 1)]

    pq.write_table(pa.table([columns["text"], pa.array(np.array([1, 2], np.float16))], names=["text", "half"]),
                   tmp_path / "half.parquet")
    with pytest.raises(ValueError, match=r"half\.parquet has a float16 column \(half\), which Spark cannot read"):
        spark_io.read_input(spark, str(tmp_path / "half.parquet"), "parquet", wanted)
    for names in (["text", "TEXT", "id"], ["text", "text", "id"]):
        pq.write_table(pa.table([columns["text"], columns["text"], columns["id"]], names=names), tmp_path / "d.parquet")
        with pytest.raises(ValueError, match=rf"has 2 columns named 'Text' ignoring case \({', '.join(names[:2])}\)"):
            spark_io.read_input(spark, str(tmp_path / "d.parquet"), "parquet", wanted)
    (tmp_path / "in.csv").write_text("id,text\nr1,a fine film\n")
    with pytest.raises(ValueError, match=r"has no column 'body' \(--text-column\); its columns: id, text$"):
        spark_io.read_input(spark, str(tmp_path / "in.csv"), "csv", {"--text-column": "body"})


def test_a_parquet_column_named_like_the_jobs_own_is_an_ordinary_column(spark, in_store, tmp_path):
    """Valid reviews were refused as "malformed CSV row" because the input had a column `_malformed_row`."""
    pd.DataFrame({"id": ["r1", "r2"], "text": ["a fine film", "a dull film"],
                  "_malformed_row": ["anything", None]}).to_parquet(tmp_path / "in.parquet")
    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out"), in_store["uri"],
                                  id_column="id", max_chars=MAX_CHARS)
    assert (summary.scored, summary.errors) == (2, 0)
    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "by-it"), in_store["uri"],
                                  id_column="_malformed_row", max_chars=MAX_CHARS)  # even as the id
    assert (summary.scored, summary.errors) == (2, 0)


def test_an_id_column_a_csv_output_cannot_hold_is_refused_before_the_model_loads(spark, tmp_path):
    pd.DataFrame({"id": [{"a": 1}], "text": ["a fine film"]}).to_parquet(tmp_path / "in.parquet")
    with pytest.raises(ValueError, match=r"the id column 'id' is struct<a:bigint>, which a CSV output cannot hold"):
        batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out.csv"), "models:/never-loaded",
                            id_column="id", max_chars=MAX_CHARS)
    assert not (tmp_path / "out.csv").exists()


def test_an_error_of_sparks_that_nothing_recognised_is_its_first_meaningful_line(spark, model, tmp_path,
                                                                                 monkeypatch, capsys):
    """The last resort: a Spark or Py4J error is one line (the cause that is not a wrapper of Spark's), the full
    traceback in a log file it names, exit 1. Here two Parquet files give the text column two types."""
    folder = tmp_path / "in"
    folder.mkdir()
    pd.DataFrame({"id": [1], "text": ["a fine film"]}).to_parquet(folder / "a.parquet")
    pd.DataFrame({"id": [2], "text": [42]}).to_parquet(folder / "b.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": model["store"].tracking_uri}}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as failed:
        batch_scoring.main(["--input", "in", "--output", "out", "--id-column", "id", "--params", "params.yaml"])
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert failed.value.code == 1 and "Traceback" not in err
    assert re.fullmatch(r"error: Spark failed: Parquet column cannot be converted in file \S+/[ab]\.parquet\. Column: "
                        r"\[text\], Expected: \w+, Found: \w+\. \(the full traceback: (\S+\.log); Spark's own log "
                        r"lines are above\)", line)
    log = Path(re.search(r"the full traceback: (\S+\.log)", line)[1])
    assert "Py4JJavaError" in log.read_text()
    log.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "params.yaml"]


def test_a_message_of_sparks_is_read_down_to_the_line_that_says_what_went_wrong():
    from pipeline.deployment.batch_failures import first_line

    worker = ("An exception was thrown from the Python worker. Please see the stack trace below.\nTraceback (most "
              "recent call last):\n  File \"/w.py\", line 1, in f\n    x = y\n        ^\nUnicodeDecodeError: 'utf-8' "
              "codec can't decode byte 0xe9\n")
    assert first_line(worker) == "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"
    assert first_line("org.apache.spark.SparkException: Job aborted\n\tat org.x(Y.scala:1)") == "Job aborted"
    assert first_line("java.lang.NullPointerException") == "NullPointerException"
    assert first_line("[UNABLE_TO_INFER_SCHEMA] Unable to infer schema for Parquet.") == (
        "[UNABLE_TO_INFER_SCHEMA] Unable to infer schema for Parquet.")


def test_progress_counts_the_write_stages_tasks_as_tasks():
    """The write unions each partition's scored rows and refused rows, two tasks a partition: a 20-partition job
    showed "17/40 partitions done"."""
    from types import SimpleNamespace

    write = SimpleNamespace(stageId=6, numTasks=40, numCompletedTasks=17, numActiveTasks=2)
    count = SimpleNamespace(stageId=7, numTasks=1, numCompletedTasks=0, numActiveTasks=1)
    assert spark_io.progress_line(12.4, [write, count], partitions=20) == (
        "[12 s] stage 6: 17/40 tasks done (each partition's scored and refused rows), 2 running; "
        "stage 7: 0/1 tasks done, 1 running")
    assert spark_io.progress_line(3, []) is None


def test_an_id_column_with_nulls_or_repeats_is_warned_of(spark, in_store, tmp_path, capsys):
    """Answers are joined back to the input by id: a null or repeated id loses that, silently before."""
    pd.DataFrame({"id": ["a", "a", None, "b"], "text": pd.array([1, 2, 3, 4], dtype="Int64")}).to_parquet(
        tmp_path / "in.parquet")
    summary = batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "out.csv"), in_store["uri"],
                                  id_column="id", max_chars=MAX_CHARS)
    assert summary.rows_out == 4
    assert ("warning: the id column 'id' is null in 1 row(s) and repeats another row's id in 1: their answers cannot "
            "be joined back to their rows by id") in capsys.readouterr().err
    batch_scoring.score(spark, str(tmp_path / "in.parquet"), str(tmp_path / "by-row"), in_store["uri"],
                        max_chars=MAX_CHARS)  # the added row_id: unique, not counted
    assert "warning" not in capsys.readouterr().err
