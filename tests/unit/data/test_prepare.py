"""Unit: the prepare stage records each prepared split in MLflow as a dataset input with a digest of its content
(real SQLite store; a small parquet source of synthetic reviews)."""

from __future__ import annotations

import dataclasses
import warnings

import mlflow
import pandas as pd
import pytest

from pipeline.core.params import DataParams, MlflowParams, ModelParams, Params
from pipeline.core.parent_run import start_tracking
from pipeline.data.prepare import run_prepare_stage
from pipeline.modeling import load_tokenizer
from tests.factories import synthetic_reviews


def test_prepare_logs_every_split_as_a_dataset_input(tmp_path, monkeypatch, tracking_store):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "imdb"
    source.mkdir()
    synthetic_reviews(60, seed=1).to_parquet(source / "train.parquet")
    synthetic_reviews(40, seed=2).to_parquet(source / "test.parquet")
    params = Params(data=DataParams(local_dir=str(source), train_count=50, val_count=20, train_subsample=None,
                                    val_subsample=None, test_subsample=None, max_length=32),
                    model=ModelParams(source="tiny"),
                    mlflow=MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-prep"))
    run_prepare_stage(params=params, tokenizer=load_tokenizer(params.model), prepared_dir=tmp_path / "prepared",
                      tokenized_dir=tmp_path / "tokenized", metrics_path=tmp_path / "prepare.json",
                      run_context=start_tracking(params.mlflow, run_id="unit-prepare"))
    runs = mlflow.search_runs(experiment_names=["unit-prep"], output_format="list",
                              filter_string="tags.`pipeline.stage` = 'prepare'")
    assert len(runs) == 1 and runs[0].data.metrics["wall_time_s"] > 0
    inputs = {i.dataset.name: i for i in runs[0].inputs.dataset_inputs}
    assert set(inputs) == {"imdb-train", "imdb-val", "imdb-test"}
    contexts = {name: {t.value for t in i.tags if t.key == "mlflow.data.context"} for name, i in inputs.items()}
    assert contexts == {"imdb-train": {"training"}, "imdb-val": {"validation"}, "imdb-test": {"test"}}
    digests = {i.dataset.digest for i in inputs.values()}
    assert len(digests) == 3 and all(digests)
    train = pd.read_parquet(tmp_path / "prepared" / "train.parquet")
    with warnings.catch_warnings():  # MLflow's notes on resolving a local source and on integer columns
        warnings.simplefilter("ignore", UserWarning)
        expected = mlflow.data.from_pandas(train, source=str(source), name="imdb-train", targets="label").digest
    assert inputs["imdb-train"].dataset.digest == expected  # the digest is of the prepared split's content
    assert str(source.resolve()) in inputs["imdb-train"].dataset.source


def test_a_prepare_that_dies_mid_split_leaves_the_previous_splits_whole(tmp_path, monkeypatch):
    """Both folders are swapped in whole: a run that fails while tokenizing its second split leaves the first run's
    files byte for byte, and no hidden build folder survives it; a run without a transfer split drops the old one."""
    import pipeline.data.prepare as prepare_module
    from pipeline.data.prepare import prepare

    source = tmp_path / "imdb"
    source.mkdir()
    synthetic_reviews(60, seed=1).to_parquet(source / "train.parquet")
    synthetic_reviews(40, seed=2).to_parquet(source / "test.parquet")
    data = DataParams(local_dir=str(source), train_count=50, val_count=20, train_subsample=None,
                      val_subsample=None, test_subsample=None, max_length=32)
    tokenizer = load_tokenizer(ModelParams(source="tiny"))
    prepared, tokenized = tmp_path / "prepared", tmp_path / "tokenized"
    prepare(data, tokenizer, prepared, tokenized, tmp_path / "prepare.json")
    (tokenized / "transfer.parquet").write_bytes(b"an earlier run's transfer split")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.parquet")}

    calls = []
    real = prepare_module.tokenize_frame

    def dies_on_the_second_split(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-split")
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "tokenize_frame", dies_on_the_second_split)
    changed = dataclasses.replace(data, max_length=24)
    with pytest.raises(KeyboardInterrupt):
        prepare(changed, tokenizer, prepared, tokenized, tmp_path / "prepare.json")
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.parquet")} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    monkeypatch.setattr(prepare_module, "tokenize_frame", real)
    prepare(changed, tokenizer, prepared, tokenized, tmp_path / "prepare.json")
    assert sorted(p.name for p in tokenized.glob("*.parquet")) == ["test.parquet", "train.parquet", "val.parquet"]
    assert pd.read_parquet(tokenized / "train.parquet")["length"].max() <= 24
