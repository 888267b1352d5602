"""Unit: params sections are validated pydantic dataclasses whose errors name the dotted keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.params import (
    DataParams,
    Params,
    ParamsError,
    PruneParams,
    QuantizeParams,
    TrainParams,
    json_schema,
    main,
    parse_params,
    read_params,
    resolve_auto,
    section,
    set_value,
)
from tests.factories import ROOT


def error_keys(raw: dict) -> set[str]:
    """The dotted keys a `ParamsError` for `raw` names (one `key: problem` per error, on one line)."""
    with pytest.raises(ParamsError) as err:
        parse_params(raw, where="p")
    text = str(err.value)
    assert "\n" not in text and text.startswith("p: ")
    return {line.split(": ")[0] for line in text.removeprefix("p: ").split("; ")}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"train": {"epoch": 1}}, "train.epoch"),  # unknown key
        ({"pruning": {}}, "pruning"),  # unknown section
        ({"train": {"epochs": "3"}}, "train.epochs"),  # strings are not coerced
        ({"train": {"epochs": True}}, "train.epochs"),  # nor booleans to numbers
        ({"train": {"epochs": 2.0}}, "train.epochs"),  # nor floats to ints
        ({"train": {"epochs": 0}}, "train.epochs"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"precision": "fp8"}}, "train.precision"),
        ({"train": {"launcher": "slurm"}}, "train.launcher"),
        ({"train": {"persistent_workers": True}}, "train.persistent_workers"),
        ({"train": {"min_nodes": 3, "num_nodes": 2}}, "train.min_nodes"),
        ({"train": {"rdzv_endpoint": "localhost"}}, "train.rdzv_endpoint"),
        ({"train": {"rdzv_endpoint": "host:70000"}}, "train.rdzv_endpoint"),
        ({"train": {"checkpoint_dir": " "}}, "train.checkpoint_dir"),
        ({"train": {"max_length": 256}}, "train.max_length"),  # above data.max_length (192)
        ({"data": {"test_count": "all"}}, "data.test_count"),
        ({"data": {"train_subsample": 1}}, "data.train_subsample"),
        ({"data": {"head_fraction": 1.5}}, "data.head_fraction"),
        ({"data": {"max_length": 1024}}, "data.max_length"),
        ({"distill": {"teacher_reads": "all"}}, "distill.teacher_reads"),
        ({"distill": {"enabled": "yes"}}, "distill.enabled"),
        ({"quantize": {"calibration_methods": ["minmax", "kl"]}}, "quantize.calibration_methods[1]"),
        ({"quantize": {"calibration_methods": []}}, "quantize.calibration_methods"),
        ({"quantize": {"weight_format": "s4"}}, "quantize.weight_format"),
        ({"quantize": {"qat_distillation": 1.5}}, "quantize.qat_distillation"),
        ({"prune": {"damp": 1.0}}, "prune.damp"),
        ({"tensorrt": {"opt_batch": 128}}, "tensorrt.opt_batch"),
        ({"tensorrt": {"min_seq": 64, "opt_seq": 32}}, "tensorrt.min_seq"),
        ({"tensorrt": {"min_seq": 200, "opt_seq": 256}}, "tensorrt.min_seq"),  # above data.max_length
        ({"benchmark": {"seq_len": 256}}, "benchmark.seq_len"),  # above data.max_length (192)
        ({"benchmark": {"iterations": 2, "rounds": 5}}, "benchmark.iterations"),
        ({"benchmark": {"bf16_row": "on"}}, "benchmark.bf16_row"),
        ({"mlflow": {"champion_alias": ""}}, "mlflow.champion_alias"),
        ({"package": {"prefer": "size"}}, "package.prefer"),
        ({"package": {"max_json_depth": 1}}, "package.max_json_depth"),
        ({"package": {"max_json_depth": 3}}, "package.max_json_depth"),  # MLflow's dataframe_split needs 4
    ],
)
def test_a_bad_value_is_refused_naming_its_key(raw, key):
    assert error_keys(raw) == {key}


def test_every_error_is_reported_at_once():
    assert error_keys({"train": {"lr": -1, "epochs": 0}, "prune": {"heads": 0}}) == {"train.lr", "train.epochs",
                                                                                     "prune.heads"}


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(ParamsError, match=r"train\.epoch: unknown key in 'train' \(known: epochs, batch_size"):
        section({"train": {"epoch": 1}}, "train", TrainParams)


def test_numbers_keep_their_type():
    t = section({"train": {"lr": 1, "epochs": 2, "attention_dropout": None}}, "train", TrainParams)
    assert (t.lr, type(t.lr), t.epochs, t.attention_dropout) == (1.0, float, 2, None)


def test_sections_built_in_code_are_validated_too():
    """Building a section, `dataclasses.replace` included (finetune, distill and quantize use it), checks it."""
    with pytest.raises(ParamsError, match=r"^prune\.heads: must be greater than or equal to 1 \(got 0\)$"):
        PruneParams(heads=0)
    with pytest.raises(ParamsError, match=r"^train\.precision: "):
        dataclasses.replace(TrainParams(), precision="fp8")
    assert dataclasses.replace(QuantizeParams(), weight_format="s7").weight_format == "s7"
    assert type(TrainParams(epochs=np.int64(2)).epochs) is int  # code may count with numpy; files may not say "2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainParams().lr = 1.0  # type: ignore[misc]


@given(st.integers(1, 80), st.integers(1, 80), st.integers(1, 80))
def test_tensorrt_batch_shapes_must_grow(low, opt, high):
    raw = {"tensorrt": {"min_batch": low, "opt_batch": opt, "max_batch": high}}
    if low <= opt <= high:
        assert parse_params(raw).tensorrt.opt_batch == opt
    else:
        assert error_keys(raw) == {"tensorrt.opt_batch"}


@given(st.integers(8, 512), st.one_of(st.none(), st.integers(8, 512)))
def test_training_window_is_at_most_the_inference_length(data_len, train_len):
    raw = {"data": {"max_length": data_len}, "train": {"max_length": train_len}, "tensorrt": {"min_seq": 8},
           "benchmark": {"seq_len": 8}}
    if train_len is None or train_len <= data_len:
        assert parse_params(raw).train.max_length == train_len
    else:
        assert error_keys(raw) == {"train.max_length"}


def test_auto_settings_resolve_once_for_a_machine():
    every_auto = parse_params({"distill": {"enabled": "auto"}})  # the others are `auto` by default
    avx2 = resolve_auto(every_auto, flags=frozenset({"avx2"}), cuda=False)
    assert (avx2.precision.value, avx2.distill.value, avx2.weight_format.value, avx2.bf16_row.value,
            avx2.qat_precision.value) == ("32-true", False, "u8", False, "32-true")
    amx = resolve_auto(every_auto, flags=frozenset({"avx512_vnni", "amx_bf16", "amx_int8"}), cuda=False)
    assert (amx.precision.value, amx.distill.value, amx.weight_format.value, amx.bf16_row.value,
            amx.qat_precision.value) == ("bf16-mixed", True, "s8", True, "bf16-mixed")
    resolved = amx.apply(every_auto)
    assert (resolved.train.precision, resolved.distill.enabled, resolved.quantize.weight_format,
            resolved.benchmark.bf16_row, resolved.quantize.qat_precision) == ("bf16-mixed", True, "s8", True,
                                                                              "bf16-mixed")
    assert set(amx.choices()) == {"train.precision", "distill.enabled", "quantize.weight_format", "benchmark.bf16_row",
                                  "quantize.qat_precision"}
    with pytest.raises(ValueError, match="still 'auto'"):
        every_auto.quantize.trainer_precision()
    assert resolved.quantize.trainer_precision() == "bf16-mixed"


def test_explicit_settings_are_kept_by_resolve_auto():
    params = parse_params({"train": {"precision": "bf16-true"}, "distill": {"enabled": False},
                           "quantize": {"weight_format": "s7", "qat_precision": "bf16-mixed"},
                           "benchmark": {"bf16_row": True}})
    r = resolve_auto(params, flags=frozenset(), cuda=False)
    assert [c.reason for c in (r.precision, r.distill, r.weight_format, r.bf16_row, r.qat_precision)] == \
        ["set explicitly"] * 5
    assert r.apply(params) == params


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
    for key in ("data.nope", "nope.seed", "data.seed.x"):
        with pytest.raises(ParamsError, match="unknown key"):
            set_value(p, key, "1")


def test_command_gets_sets_and_checks(tmp_path, capsys):
    p = tmp_path / "params.yaml"
    p.write_text("mlflow:\n  champion_alias: prod\ndata:\n  seed: 1\n")
    main(["--params", str(p), "get", "mlflow.champion_alias"])
    main(["--params", str(p), "get", "mlflow.registered_model_name"])  # a default the file leaves out
    main(["--params", str(p), "set", "data.seed=7"])
    main(["--params", str(p), "get", "data.seed"])
    assert [line for line in capsys.readouterr().out.splitlines() if ":" not in line] == ["prod", "imdb-sentiment",
                                                                                         "7"]
    before = p.read_text()
    for argv in (["get", "mlflow.nope"], ["set", "data.seed=3", "data.train_count=0"], ["set", "data.seed"],
                 ["set", "data.seed=3", "data.seed=[unclosed"]):  # a value that is not YAML, after a good one
        with pytest.raises(SystemExit) as stop:
            main(["--params", str(p), *argv])
        assert stop.value.code == 2, argv
    assert p.read_text() == before  # a refused `set` leaves the file as it was
    assert capsys.readouterr().err.count("error: ") == 4
    assert [f.name for f in tmp_path.iterdir()] == ["params.yaml"]  # no temporary file left beside it


def test_published_schema_is_current():
    """`docs/params.schema.json` is what `python -m pipeline.core.params schema` writes."""
    assert json.loads((ROOT / "docs" / "params.schema.json").read_text()) == json_schema()
    assert (ROOT / "params.yaml").read_text().startswith("# yaml-language-server: $schema=docs/params.schema.json")


def test_schema_states_bounds_and_closed_sets():
    defs = json_schema()["$defs"]
    assert defs["TrainParams"]["additionalProperties"] is False
    assert defs["TrainParams"]["properties"]["lr"]["exclusiveMinimum"] == 0
    assert defs["QuantizeParams"]["properties"]["calibration_methods"]["items"]["enum"] == [
        "minmax", "percentile", "entropy"]
    assert defs["DataParams"]["properties"]["local_dir"]["description"].startswith("the local copy")


def test_weight_formats_have_one_definition():
    from pipeline.core import machine
    from pipeline.core.params import WEIGHT_FORMATS

    assert machine.WEIGHT_FORMATS is WEIGHT_FORMATS == ("s8", "s7", "u8")


def test_rules_across_sections_hold_for_files_not_for_params_assembled_in_code():
    assembled = Params(data=DataParams(max_length=64))  # a test's or benchmark's few sections
    assert assembled.train.max_length == 128
    assert error_keys({"data": {"max_length": 64}}) == {"train.max_length", "benchmark.seq_len"}


def test_a_named_params_file_that_is_missing_is_an_error_not_the_defaults(tmp_path, monkeypatch):
    from pipeline.core.params import DEFAULT_PARAMS_FILE, Params, load_params_or_defaults

    monkeypatch.chdir(tmp_path)
    assert load_params_or_defaults(DEFAULT_PARAMS_FILE) == Params()  # no checkout here: the defaults
    with pytest.raises(FileNotFoundError, match=r"prams\.yaml does not exist"):
        load_params_or_defaults(Path("prams.yaml"))
    (tmp_path / "params.yaml").write_text("mlflow:\n  champion_alias: staging\n")
    assert load_params_or_defaults(DEFAULT_PARAMS_FILE).mlflow.champion_alias == "staging"


def test_a_profile_over_a_params_file_that_is_not_the_defaults_names_what_it_keeps(tmp_path, capsys):
    """`dvc exp run` rewrites params.yaml with the profile it ran: the next profile would compose over that one's
    values. The overrides command still prints the arguments, and names on stderr each key that is not the default."""
    from pipeline.core.settings.profiles import profile_overrides

    profile = ROOT / "profiles" / "mini.yaml"
    p = tmp_path / "params.yaml"
    p.write_text((ROOT / "params.yaml").read_text())
    main(["--params", str(p), "overrides", str(profile)])
    out = capsys.readouterr()
    assert out.out.split() == profile_overrides(profile) and out.err == ""  # the defaults: nothing to say
    main(["--params", str(p), "set", "train.epochs=3", "quantize.build=[int8-dynamic]"])
    capsys.readouterr()
    main(["--params", str(p), "overrides", str(profile)])
    out = capsys.readouterr()
    assert out.out.split() == profile_overrides(profile)
    assert "train.epochs=3 (default 1)" in out.err and "quantize.build=['int8-dynamic']" in out.err, out.err
    assert f"git checkout {p}" in out.err
