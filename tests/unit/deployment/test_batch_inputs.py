"""Unit: what batch scoring (`pipeline.deployment.batch_scoring`) refuses before Spark starts, or before the model
loads (`pipeline.deployment.batch_inputs`), found by a hostile-input probe: each refusal is one line naming the
problem and what to do, and no file of the user's is touched. No Spark session here: the command is stopped by
its checks, or `spark_session` fails the test."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from pipeline.deployment import batch_inputs, batch_scoring, spark_io


@pytest.fixture
def command(tmp_path, monkeypatch):
    """The command's arguments up to `--output`, run in `tmp_path` with an input (`in.parquet`) and a params file
    whose store is never opened; Spark may not start."""
    pd.DataFrame({"id": ["r1"], "text": ["a fine film"]}).to_parquet(tmp_path / "in.parquet")
    store = {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(store))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spark_io, "spark_session", lambda *a, **k: pytest.fail("Spark started"))
    return ["--input", "in.parquet", "--params", "params.yaml"]


def test_an_output_named_with_glob_characters_is_refused_and_a_folder_of_yours_survives(command, tmp_path):
    """`--overwrite` deleted `precious[x]/` (the checks took the name for a glob and looked no further, and Spark's
    overwrite deletes the literal folder), and the count read `sc[2].parquet` back as `sc2.parquet`."""
    precious = tmp_path / "out" / "precious[x]"
    precious.mkdir(parents=True)
    (precious / "thesis.txt").write_text("years of work")
    for out in ("out/precious[x]", "out/sc[2].parquet", "out/a*b", "out/{a,b}.csv", "out/x?", "out/a\\b"):
        with pytest.raises(SystemExit) as refused:
            batch_scoring.main([*command, "--output", out, "--overwrite"])
        assert "holds a glob character" in str(refused.value.code) and "\n" not in str(refused.value.code), out
    assert (precious / "thesis.txt").read_text() == "years of work"
    with pytest.raises(ValueError, match="holds a glob character"):  # whatever the file system
        batch_inputs.check_output("s3a://b/in/", "s3a://b/sc[2].parquet", True)


def test_an_input_that_exists_under_a_name_spark_reads_as_a_pattern_is_refused(tmp_path):
    """Spark globs every path it reads: `rev[1].parquet` read `rev1.parquet`. A pattern that names no file as
    spelled is a glob, left to Spark."""
    pd.DataFrame({"text": ["the one named"]}).to_parquet(tmp_path / "rev[1].parquet")
    pd.DataFrame({"text": ["another"]}).to_parquet(tmp_path / "rev1.parquet")
    with pytest.raises(ValueError, match=r"rev\[1\]\.parquet exists, but its name holds a glob character"):
        batch_inputs.check_input(str(tmp_path / "rev[1].parquet"), "parquet")
    with pytest.raises(ValueError, match="glob character"):
        batch_inputs.check_input(f"file://{tmp_path}/rev[1].parquet", "parquet")
    batch_inputs.check_input(str(tmp_path / "rev[0-9].parquet"), "parquet")
    assert batch_inputs.local_path(f"file://{tmp_path}/*.parquet") is None
    assert batch_inputs.hadoop_literal("/d/rev[1]{a}*?.parquet") == "/d/rev\\[1\\]\\{a\\}\\*\\?.parquet"


def test_an_id_column_named_like_an_output_column_in_any_case_is_refused():
    """`--id-column Label` passed the check and failed in Spark (COLUMN_ALREADY_EXISTS: Spark ignores case)."""
    for name in ("Label", "SCORE", "Error", "error"):
        with pytest.raises(ValueError, match="name of an output column"):
            batch_inputs.check_columns(name, "text")
    batch_inputs.check_columns("labels", "text")


def test_a_master_url_spark_does_not_know_is_one_line_before_spark_starts(command):
    """`--master bogus` printed Spark's Java trace and pyspark's JAVA_GATEWAY_EXITED traceback."""
    with pytest.raises(SystemExit) as refused:
        batch_scoring.main([*command, "--output", "out", "--master", "bogus"])
    assert str(refused.value.code).startswith("error: --master 'bogus' is not a master URL Spark knows")
    for master in ("local", "local[2]", "local[*]", "local[4, 3]", "local-cluster[2, 1, 1024]", "yarn",
                   "spark://head:7077", "k8s://https://k8s.example:443", "mesos://m:5050"):
        batch_inputs.check_master(master)
    for master in ("bogus", "local[x]", "spark:/head", "yarn-client2"):
        with pytest.raises(ValueError, match="not a master URL"):
            batch_inputs.check_master(master)


def test_an_output_spark_could_not_write_is_refused_before_spark_starts(tmp_path):
    """Under a regular file, or under /proc, Spark failed only after the model's load and a pass over the input."""
    (tmp_path / "reviews.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"cannot be created: \S+reviews\.parquet is a file, not a folder"):
        batch_inputs.check_output("in.parquet", str(tmp_path / "reviews.parquet" / "x" / "out"), False)
    with pytest.raises(ValueError, match=r"the output /proc/x/out cannot be written: no folder can be made in /proc"):
        batch_inputs.check_output("in.parquet", "/proc/x/out", False)
    batch_inputs.check_output("in.parquet", str(tmp_path / "new" / "deeper" / "out"), False)  # Spark makes parents
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reviews.parquet"]  # the probe left nothing


def test_inputs_spark_would_skip_or_fail_on_are_named_with_the_reason(tmp_path):
    """Spark ignores `_x.parquet` and `.x.parquet` (UNABLE_TO_INFER_SCHEMA); a 0-byte `.parquet` was told to pass
    --format csv; a truncated one failed in Spark with an error that names no file."""
    frame = pd.DataFrame({"text": ["a fine film"]})
    for name in ("_x.parquet", ".x.parquet"):
        frame.to_parquet(tmp_path / name)
        with pytest.raises(ValueError, match=r"Spark skips a file whose name begins with _ or \."):
            batch_inputs.check_input(str(tmp_path / name), "parquet")
    with pytest.raises(ValueError, match=r"holds no \.csv or \.parquet file directly in it .*Spark skips a file whose "
                                         r"name begins with _ or \., as \.x\.parquet, _x\.parquet: rename it"):
        batch_inputs.input_format(str(tmp_path))
    with pytest.raises(ValueError, match="holds no file Spark reads; Spark skips"):
        batch_inputs.check_input(str(tmp_path), "parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet is empty \(0 bytes\), not a Parquet file"):
        batch_inputs.check_input(str(tmp_path / "empty.parquet"), "parquet")
    frame.to_parquet(tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    for cut in (data[: len(data) // 2], data[:-9] + b"PAR1", data[:6]):  # cut short, or its footer lost
        (tmp_path / "cut.parquet").write_bytes(cut)
        with pytest.raises(ValueError, match=r"cut\.parquet is not a whole Parquet file"):
            batch_inputs.check_input(str(tmp_path / "cut.parquet"), "parquet")
    batch_inputs.check_input(str(tmp_path / "whole.parquet"), "parquet")


def test_an_empty_csv_input_is_refused_before_spark_starts(tmp_path):
    """A 0-byte CSV (or a folder of only such files) has no header to name its text column: refused with one line
    before Spark starts (it read no columns, then reported the text column missing among none). An empty file beside
    CSV files with rows is Spark's to read (it holds no rows), and a header-only CSV is a valid empty input."""
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.csv is empty \(0 bytes\): a CSV input needs a header row"):
        batch_inputs.check_input(str(tmp_path / "empty.csv"), "csv")
    (tmp_path / "also-empty.csv").write_bytes(b"")
    with pytest.raises(ValueError, match=r"every CSV file of .* is empty \(0 bytes\)"):
        batch_inputs.check_input(str(tmp_path), "csv")
    (tmp_path / "rows.csv").write_text("text\na fine film\n")
    batch_inputs.check_input(str(tmp_path), "csv")
    (tmp_path / "header.csv").write_text("text\n")
    batch_inputs.check_input(str(tmp_path / "header.csv"), "csv")
