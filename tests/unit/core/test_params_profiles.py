"""One source for each setting: `Params` defaults are the default profile, profiles only override it and DVC's
Hydra composition applies them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.core.params import (
    Params,
    ParamsError,
    flatten,
    load_params,
    parse_params,
    profile_overrides,
    read_profile,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[3]
PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))


def test_defaults_are_the_default_profile():
    assert load_params(ROOT / "params.yaml") == Params()


def test_params_yaml_lists_every_key_so_dvc_tracks_it():
    from pipeline.core.params import read_params

    assert set(flatten(read_params(ROOT / "params.yaml"))) == set(flatten(dataclasses.asdict(Params())))


def test_every_section_is_validated():
    raw = {"prune": {"heads": 0}}
    with pytest.raises(ParamsError, match=r"prune\.heads"):
        parse_params(raw)
    with pytest.raises(ParamsError, match="unknown section"):
        parse_params({"pruning": {}})


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_profiles_hold_only_keys_that_differ(profile):
    defaults = flatten(dataclasses.asdict(Params()))
    overrides = read_profile(profile)
    assert overrides, profile
    same = {k: v for k, v in overrides.items() if defaults[k] == v}
    assert not same, f"{profile.name} repeats default values: {same}"


def _hydra_repo(d: Path) -> None:
    """params.yaml, profiles/ and the repo's `.dvc/config` (DVC's Hydra composition) copied into `d`."""
    import shutil

    shutil.copy(ROOT / "params.yaml", d / "params.yaml")
    shutil.copytree(ROOT / "profiles", d / "profiles")
    (d / ".dvc").mkdir()
    shutil.copy(ROOT / ".dvc" / "config", d / ".dvc" / "config")


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_dvcs_hydra_composition_of_each_profile_is_params_merged_with_it(profile, tmp_path):
    """What `dvc exp run -S +profiles=<name>` writes into params.yaml, composed in this process by the function DVC
    calls for it (`dvc.utils.hydra.compose_and_dump`) with the repo's `.dvc/config` settings: params.yaml merged with
    what the profile says. (`test_a_profile_round_trips_through_dvc_exp_run` runs the real command once.)"""
    import configparser

    from dvc.utils.hydra import compose_and_dump

    _hydra_repo(tmp_path)
    hydra = configparser.ConfigParser()
    hydra.read(tmp_path / ".dvc" / "config")
    args = profile_overrides(profile)
    assert args[0] == "-S" and len(args) == 2, args
    compose_and_dump(tmp_path / "params.yaml", str(tmp_path / hydra["hydra"]["config_dir"]), None,
                     hydra["hydra"]["config_name"], str(tmp_path), [args[1]])
    expected = parse_params(with_overrides(dataclasses.asdict(Params()), read_profile(profile)))
    assert load_params(tmp_path / "params.yaml") == expected


def test_a_profile_round_trips_through_dvc_exp_run(tmp_path):
    """`make run PROFILE=...` passes these arguments to `dvc exp run`, whose Hydra composition (the repo's
    `.dvc/config`) must write params.yaml merged with what the profile says: the real command, on the profile
    `make test` runs end to end (every profile's composition: the test above)."""
    import subprocess
    import sys

    profile = ROOT / "profiles" / "mini.yaml"
    dvc = str(Path(sys.executable).with_name("dvc"))
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    _hydra_repo(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: echo ok\n    params: [data, model, train, quantize]\n")
    for cmd in (["git", "init", "-q"], [dvc, "init", "-q", "--force"], ["cp", str(ROOT / ".dvc" / "config"),
                                                                          ".dvc/config"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "i"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    proc = subprocess.run([dvc, "exp", "run", *profile_overrides(profile)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = parse_params(with_overrides(dataclasses.asdict(Params()), read_profile(profile)))
    assert load_params(tmp_path / "params.yaml") == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("# @package _global_\ntrain:\n  epoch: 3\n", r"unknown key\(s\) train\.epoch"),
        ("train:\n  epochs: 3\n", "first line must be '# @package _global_'"),  # Hydra would nest it
        ("# @package _global_\ndata:\n  max_length: 64\n",  # below train.max_length's default, 128
         r"bad\.yaml: train\.max_length: must be at most data\.max_length \(64\)"),
    ],
)
def test_a_bad_profile_is_refused_before_dvc_runs(tmp_path, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ParamsError, match=needle):
        profile_overrides(bad)


def test_a_profile_is_a_hydra_config_group_option():
    assert profile_overrides(ROOT / "profiles" / "cpu-long.yaml") == ["-S", "+profiles=cpu-long"]
