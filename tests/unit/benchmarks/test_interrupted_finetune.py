"""`benchmarks.interrupted_finetune`'s params: each run's file is this checkout's params.yaml with the overrides,
written and read back by the config loader (YAML 1.2: `5e-05` is a number, which a YAML 1.1 reader takes for a
string)."""

from __future__ import annotations

from benchmarks.interrupted_finetune import run_params
from pipeline.core.params import load_params


def test_a_runs_params_carry_the_overrides_its_checkpoints_and_its_store(tmp_path):
    every = run_params(tmp_path, ["train.lr=5e-05", "train.checkpoint_every_n_steps=7"])
    params = load_params(tmp_path / "params.yaml")
    assert params.train.lr == 5e-05 and isinstance(params.train.lr, float)
    assert every == 7 == params.train.checkpoint_every_n_steps
    assert params.train.checkpoint_dir == str(tmp_path / "checkpoints")
    assert params.mlflow.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert "#" in (tmp_path / "params.yaml").read_text()  # comments kept
