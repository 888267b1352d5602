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
