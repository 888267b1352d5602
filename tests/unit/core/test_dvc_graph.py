"""`dvc.yaml` stays true: every module a stage imports lies under one of its declared deps, prepare depends on
the local IMDB copy, and the variant directories follow the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from pipeline.runtimes.catalog import built_by, with_directories

ROOT = Path(__file__).resolve().parents[3]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


#: Top-level packages whose files a stage's code deps must cover.
PROJECT_PACKAGES = ("pipeline", "serving", "stages")


def _module_file(module: str) -> Path | None:
    for candidate in (ROOT / (module.replace(".", "/") + ".py"), ROOT / module.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path) -> set[str]:
    """Project modules imported anywhere in the file (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PROJECT_PACKAGES)
    return out


def import_closure(stage: str) -> set[Path]:
    seen: set[str] = set()
    todo = [f"stages.{stage}"]
    files: set[Path] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is not None:
            files.add(path.relative_to(ROOT))
            todo.extend(_imported(path))
            parent = module.rsplit(".", 1)[0]
            if parent != module and _module_file(parent):
                todo.append(parent)
    return files


def _is_marker(path: Path) -> bool:
    """A package `__init__.py` that holds no code (a docstring and constants at most): nothing a stage runs."""
    body = ast.parse((ROOT / path).read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(n, ast.Expr | ast.Assign) and isinstance(getattr(n, "value", None), ast.Constant) for n in body)


@pytest.mark.parametrize("stage", sorted(DVC))
def test_declared_deps_cover_the_import_graph(stage):
    deps = [Path(str(d)) for d in DVC[stage]["deps"]]
    files = [f for f in sorted(import_closure(stage)) if not _is_marker(f)]
    assert Path("pipeline/core/params.py") in files  # the graph walk does reach the code
    missing = [f for f in files if not any(f == d or d in f.parents for d in deps)]
    assert not missing, f"stage {stage} imports {missing} but dvc.yaml does not list them (or their package)"


def test_prepare_depends_on_the_imdb_source():
    assert "${data.local_dir}" in DVC["prepare"]["deps"]
    assert "data" in DVC["prepare"]["params"]  # source, hub_name and hub_revision are recorded as params


@pytest.mark.parametrize("stage", ["export", "quantize", "prune", "tensorrt"])
def test_build_stage_outs_are_its_registry_rows(stage):
    outs = {str(o) for o in DVC[stage]["outs"]}
    assert outs == {f"models/variants/{v.name}" for v in built_by(stage)}
    assert "--variants-dir models/variants" in DVC[stage]["cmd"]


def test_distill_outs_are_the_student_and_its_registry_rows():
    outs = {str(o) for o in DVC["distill"]["outs"]}
    assert outs == {"models/distilled"} | {f"models/variants/{v.name}" for v in built_by("distill")}
    assert "--variants-dir models/variants" in DVC["distill"]["cmd"]
    assert "data/tokenized" in DVC["distill"]["deps"]  # where the transfer split lives


@pytest.mark.parametrize("stage", ["evaluate", "benchmark"])
def test_readers_depend_on_every_registered_variant(stage):
    deps = {str(d) for d in DVC[stage]["deps"]}
    assert {f"models/variants/{v.name}" for v in with_directories()} <= deps


def test_package_depends_on_every_servable_variant():
    deps = {str(d) for d in DVC["package"]["deps"]}
    assert {f"models/variants/{v.name}" for v in with_directories() if v.servable} <= deps


def test_every_stage_command_runs_the_project_interpreter():
    """A stage started by `.venv/bin/dvc` with another `python` first on PATH still runs in the project's venv:
    each command names `.venv/bin/python` (a bare `python` would be whatever PATH finds, e.g. the system one)."""
    for name, stage in DVC.items():
        assert stage["cmd"].startswith(f".venv/bin/python -m stages.{name} "), (name, stage["cmd"])


def _covers(dep: Path, path: Path) -> bool:
    return path == dep or dep in path.parents


@pytest.mark.parametrize("stage", sorted(set(DVC) - {"package"}))  # package copies `pipeline` whole
def test_every_declared_code_dep_is_imported(stage):
    """No stage re-runs for code it does not import: each declared code dep holds a module of its import graph."""
    files = import_closure(stage)
    code = [Path(str(d)) for d in DVC[stage]["deps"] if str(d).startswith(("pipeline", "stages"))]
    unused = [d for d in code if not any(_covers(d, f) for f in files)]
    assert not unused, f"stage {stage} declares {unused} but imports nothing there"


@pytest.mark.parametrize("stage", ["finetune", "distill"])
def test_editing_a_builder_it_does_not_import_leaves_a_training_stage_unchanged(stage):
    """What `dvc status` sees after an edit of, say, `pipeline/variants/tensorrt.py`: the deps of finetune and
    distill cover no builder module they do not import."""
    deps = [Path(str(d)) for d in DVC[stage]["deps"]]
    imported = import_closure(stage)
    builders = sorted((ROOT / "pipeline" / "variants").glob("*.py"))
    assert Path("pipeline/variants/tensorrt.py") in [b.relative_to(ROOT) for b in builders]
    rerun = [b.relative_to(ROOT) for b in builders if b.name != "__init__.py"
             and b.relative_to(ROOT) not in imported and any(_covers(d, b.relative_to(ROOT)) for d in deps)]
    assert rerun == []
