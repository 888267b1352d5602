"""The public entry point to the settings and the only reader of `params.yaml`: load and validate a params file
into `Params`, and the `python -m pipeline.core.params` command.

The schema is `pipeline.core.settings`: each top-level section is a frozen pydantic dataclass whose defaults are
the default profile (`params.yaml` holds the same values so that DVC tracks them). Profiles (`profiles/*.yaml`)
hold only the keys that differ and are composed over `params.yaml` by DVC's Hydra composition
(`make run PROFILE=NAME`). Stages call `load_params` once in `main()` and pass the sections down; nothing else in
the code base reads `params.yaml`. Unknown keys and values of the wrong type or range fail with a one-line
`ParamsError` naming the dotted key, so a typo never silently falls back to a default. `resolve_auto` turns every
`auto` setting into its value for this machine, once per stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from pipeline.core.settings.auto import ResolvedAuto, resolve_auto
from pipeline.core.settings.builders import ExportParams, PruneParams, QuantizeParams, TensorRTParams
from pipeline.core.settings.choices import CALIBRATION_METHODS, TEACHER_READS, WEIGHT_FORMATS
from pipeline.core.settings.params_file import load_yaml, read_params, set_value
from pipeline.core.settings.profiles import flatten, profile_overrides, read_profile, with_overrides
from pipeline.core.settings.reporting import (
    BenchmarkParams,
    EvaluateParams,
    MlflowParams,
    PackageParams,
    TargetsParams,
)
from pipeline.core.settings.root import SECTIONS, Params, json_schema
from pipeline.core.settings.training import DataParams, DistillParams, ModelParams, TrainParams
from pipeline.core.settings.validation import ParamsError, validate

__all__ = [
    "CALIBRATION_METHODS", "SECTIONS", "TEACHER_READS", "WEIGHT_FORMATS", "BenchmarkParams", "DataParams",
    "DistillParams", "EvaluateParams", "ExportParams", "MlflowParams", "ModelParams", "PackageParams", "Params",
    "ParamsError", "PruneParams", "QuantizeParams", "ResolvedAuto", "TargetsParams", "TensorRTParams", "TrainParams",
    "flatten", "from_mapping", "json_schema", "load_params", "load_yaml", "main", "parse_params", "profile_overrides",
    "read_params", "read_profile", "resolve_auto", "section", "set_value", "to_dict", "with_overrides",
]

T = TypeVar("T")


def from_mapping(cls: type[T], values: dict[str, Any], prefix: str) -> T:
    """Build the section `cls` from a plain mapping (a recorded one, say); errors name `prefix.key`."""
    return validate(cls, values, prefix)


def section(raw: dict[str, Any], name: str, cls: type[T]) -> T:
    """Build the class for section `name` of a whole params mapping (missing: the defaults)."""
    values = raw.get(name) or {}
    if not isinstance(values, dict):
        raise ParamsError(f"params section '{name}' must be a mapping")
    return validate(cls, values, name)


def parse_params(raw: dict[str, Any], where: str = "params") -> Params:
    """`Params` from a mapping of sections, every section and every rule across sections checked."""
    try:
        return validate(Params, raw)
    except ParamsError as exc:
        raise ParamsError(f"{where}: {exc}") from None


def load_params(path: str | Path) -> Params:
    """The whole params file as `Params` (missing sections and keys take their defaults)."""
    return parse_params(read_params(path), str(path))


#: The params file the commands read by default (`--params`).
DEFAULT_PARAMS_FILE = Path("params.yaml")


def load_params_or_defaults(path: Path) -> Params:
    """The params file at `path`, or the defaults where `path` is the default `params.yaml` and there is none (a
    server or scoring job run in a directory that holds no checkout). A file that was named and does not exist is
    a `FileNotFoundError`, never silently the defaults (another registry entry, other limits)."""
    if path.is_file():
        return load_params(path)
    if path == DEFAULT_PARAMS_FILE:
        return Params()
    raise FileNotFoundError(f"params file {path} does not exist (leave --params out to use the defaults)")


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain dict of a params section (or of `Params`), for JSON files and MLflow params."""
    return dataclasses.asdict(obj)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.core.params [--params FILE] set KEY=VALUE... | get KEY | check [--profile P] |
    overrides PROFILE | schema [--check]` (`--help` for each)."""
    from pipeline.core.settings.command import run

    run(argv)


if __name__ == "__main__":
    main()
