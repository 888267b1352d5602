"""The code's contract with its installers: every third-party package the project's code imports is declared in
`pyproject.toml` (dependencies or an extra), and every `run_*` entry point of a stage's work takes its many paths
by keyword only, so a swapped `Path` cannot type-check into the wrong place."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ("pipeline", "stages", "serving", "benchmarks")
#: Imported only where the hardware or an opt-in profile asks, each guarded and declared as an extra.
OPTIONAL = {"tensorrt", "deepspeed", "pyspark", "py4j"}


def imported_top_levels() -> set[str]:
    """Top-level names of every module imported anywhere in the project's code (function-level imports too)."""
    names: set[str] = set()
    for package in CODE:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def declared() -> set[str]:
    """Normalized distribution names in pyproject's dependencies and optional dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {normalize(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in specs}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_declared():
    own = set(CODE) | {"tests"}
    third_party = {n for n in imported_top_levels() - own if n not in sys.stdlib_module_names and n != "__future__"}
    by_module = importlib.metadata.packages_distributions()
    missing = []
    for name in sorted(third_party):
        if name in OPTIONAL:
            continue
        distributions = {normalize(d) for d in by_module.get(name, [])}
        assert distributions, f"{name} is imported but no installed distribution provides it"
        if not distributions & declared():
            missing.append(f"{name} ({', '.join(sorted(distributions))})")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_optional_imports_are_declared_as_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {normalize(re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0])
              for specs in project["optional-dependencies"].values() for s in specs}
    assert {"tensorrt", "deepspeed", "pyspark"} <= extras


def test_every_pin_in_the_requirements_files_is_inside_pyprojects_supported_range():
    """What `make` installs (requirements*.txt) is what pyproject.toml says is supported: a range narrowed to the
    tested minor version where the code relies on a package's internals must still hold the pin."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = {normalize(r.name): r.specifier for r in map(Requirement, [
        *project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)])}
    outside = []
    for path in sorted(ROOT.glob("requirements*.txt")):
        for line in path.read_text().splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                name, version = line.split(";")[0].split("==")
                spec = ranges.get(normalize(name.split("[")[0].strip()))
                if spec is not None and not spec.contains(version.strip(), prereleases=True):
                    outside.append(f"{path.name}: {line.strip()} (pyproject: {spec})")
    assert not outside, outside


def run_functions() -> list[tuple[str, object]]:
    found = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("run_") and len(node.args.args) + len(
                    node.args.kwonlyargs) > 2:
                found.append((f"{module}.{node.name}", importlib.import_module(module)))
    return found


@pytest.mark.parametrize("qualified", [q for q, _ in run_functions()])
def test_run_entry_points_with_several_arguments_are_keyword_only(qualified):
    module, _, name = qualified.rpartition(".")
    signature = inspect.signature(getattr(importlib.import_module(module), name))
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert not positional, f"{qualified} takes {positional} by position; make them keyword-only (*, ...)"
