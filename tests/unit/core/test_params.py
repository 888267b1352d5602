"""Unit: params sections map to validated dataclasses."""

from __future__ import annotations

import pytest

from pipeline.core.params import DataParams, ParamsError, TrainParams, read_params, section, set_value


def test_defaults_and_coercion():
    raw = {"train": {"lr": 1, "epochs": 2}}
    t = section(raw, "train", TrainParams)
    assert t.lr == 1.0 and isinstance(t.lr, float) and t.epochs == 2


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"epoch": 1}, "unknown key(s) in 'train': epoch"),
        ({"epochs": "3"}, "train.epochs = '3'; expected int"),
        ({"epochs": True}, "expected int"),
        ({"precision": "fp8"}, "train.precision = 'fp8'; expected one of"),
        ({"epochs": 0}, "train.epochs must be >= 1"),
        ({"persistent_workers": True}, "persistent_workers needs"),
    ],
)
def test_bad_train_values_name_the_key(values, needle):
    with pytest.raises(ParamsError) as err:
        section({"train": values}, "train", TrainParams)
    assert needle in str(err.value)


def test_optional_ints_accept_null_and_reject_strings():
    assert section({"data": {"test_count": None}}, "data", DataParams).test_count is None
    with pytest.raises(ParamsError):
        section({"data": {"test_count": "all"}}, "data", DataParams)


def test_read_params_errors(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        read_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [1, 2\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        read_params(bad)


def test_set_value_keeps_comments(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("# top comment\ndata:\n  local_dir: a  # where\n  seed: 1\n  test_count: null\n")
    set_value(p, "data.local_dir", "/x/y")
    text = p.read_text()
    assert "# top comment" in text and "# where" in text and "test_count: null" in text
    assert read_params(p)["data"] == {"local_dir": "/x/y", "seed": 1, "test_count": None}
    with pytest.raises(ParamsError, match="unknown key"):
        set_value(p, "data.nope", "1")


def test_repo_params_file_is_valid():
    from pipeline.core.params import SECTIONS
    from tests.factories import ROOT

    raw = read_params(ROOT / "params.yaml")
    for name, cls in SECTIONS.items():
        section(raw, name, cls)
    for profile in sorted((ROOT / "profiles").glob("*.yaml")):
        raw = read_params(profile)
        for name, cls in SECTIONS.items():
            section(raw, name, cls)


def test_qat_distillation_weight_is_a_share():
    from pipeline.core.params import QuantizeParams

    assert section({"quantize": {"qat_distillation": 0.5}}, "quantize", QuantizeParams).qat_distillation == 0.5
    with pytest.raises(ParamsError, match="qat_distillation must be in"):
        section({"quantize": {"qat_distillation": 1.5}}, "quantize", QuantizeParams)


def test_get_prints_one_validated_value(tmp_path, capsys):
    from pipeline.core.params import main

    p = tmp_path / "params.yaml"
    p.write_text("mlflow:\n  champion_alias: prod\n")
    main(["--params", str(p), "get", "mlflow.champion_alias"])
    main(["--params", str(p), "get", "mlflow.registered_model_name"])  # a default the file leaves out
    assert capsys.readouterr().out.splitlines() == ["prod", "imdb-sentiment"]
    with pytest.raises(SystemExit, match=r"unknown key mlflow\.nope"):
        main(["--params", str(p), "get", "mlflow.nope"])
