"""Profiles (`profiles/*.yaml`): partial params files that DVC's Hydra composition merges over `params.yaml`
(`dvc exp run -S +profiles=NAME`, `hydra.enabled` in `.dvc/config`). Here: checking one before a run, and the
dotted-key view of params that the checks and the run records compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core.settings.params_file import read_params
from pipeline.core.settings.root import Params
from pipeline.core.settings.validation import ParamsError, validate

#: A profile's first line: Hydra merges the file at the root of the composed config, not under `profiles:`.
HYDRA_HEADER = "# @package _global_"


def flatten(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1e-4}}` -> `{"train.lr": 1e-4}` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def with_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each dotted key of `overrides` set (what Hydra's merge of a profile does)."""
    merged = {name: dict(values or {}) for name, values in raw.items()}
    for dotted, value in overrides.items():
        name, _, key = dotted.partition(".")
        merged.setdefault(name, {})[key] = value
    return merged


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile's overrides as dotted keys, checked: Hydra's header, every key known, the merged params valid."""
    p = Path(path)
    overrides = flatten(read_params(p))
    if not p.read_text().startswith(HYDRA_HEADER + "\n"):
        raise ParamsError(f"{p}: the first line must be '{HYDRA_HEADER}' (Hydra then merges it over params.yaml)")
    defaults = dataclasses.asdict(Params())
    unknown = sorted(set(overrides) - set(flatten(defaults)))
    if unknown:
        raise ParamsError(f"{p}: unknown key(s) {', '.join(unknown)}")
    try:
        validate(Params, with_overrides(defaults, overrides))
    except ParamsError as exc:
        raise ParamsError(f"{p}: {exc}") from None
    return overrides


def differences_from_defaults(params: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (value, default) wherever the nested `params` differ from `defaults`."""
    mine, base = flatten(params), flatten(defaults)
    return {key: (value, base.get(key)) for key, value in mine.items() if base.get(key) != value}


def profile_overrides(path: str | Path) -> list[str]:
    """`dvc exp run` arguments that apply a checked profile: its config group (the folder) and option (the name)."""
    p = Path(path)
    read_profile(p)
    return ["-S", f"+{p.parent.name}={p.stem}"]
