"""Each DVC stage's code deps, derived from the import graph: `python -m pipeline.core.stage_deps --check` says
whether `dvc.yaml` lists exactly the module files each stage imports, `--write` rewrites those entries.

A stage runs `python -m stages.<name>`; its import closure is every project module reachable from
`stages/<name>.py` through `import` statements (function-level imports included, `if TYPE_CHECKING:` blocks
left out: they never run), plus the packages' `__init__.py` that hold code (a docstring and constants are no code).
Its code deps are those files, the files a module reads beside itself (`READS`) and what a stage copies rather
than imports (`COPIES`: modules whose own import closure it copies). Only the entries under the project's
packages are rewritten; data deps (`data/...`, `models/...`, `${data.local_dir}`), their order and every comment
stay as they are, and a code dep that stays keeps its comment. The tests (`tests/unit/core/test_dvc_graph.py`)
use the same walk."""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

#: The checkout this module lies in (`pipeline/core/stage_deps.py`).
ROOT = Path(__file__).resolve().parents[2]
#: Top-level packages whose modules are code deps; a `dvc.yaml` dep under one of them is a code dep.
PROJECT_PACKAGES = ("pipeline", "serving", "stages")
#: Files a module reads next to itself at run time: a stage that imports the module depends on them too.
READS: Mapping[str, tuple[str, ...]] = {
    "pipeline/evaluation/report.py": ("pipeline/evaluation/templates",),  # the report's jinja templates
    "pipeline/deployment/spark_io.py": ("pipeline/deployment/spark-log4j2.properties",),  # a local Spark driver's logs
}
#: What a stage copies as files besides what it imports, as the modules whose import closure it copies: `package`
#: puts the TorchServe handler (`serving/handler.py`, which the stage never imports) and every project module the
#: handler imports into the archive (`pipeline.deployment.archive`), so an edit of one of those changes
#: `model_store/sentiment.mar` and nothing else does.
COPIES: Mapping[str, tuple[str, ...]] = {
    "package": ("serving.handler",),
}
_DEP_LINE = re.compile(r"^(?P<indent>\s+)- (?P<value>\S+)(?P<rest>.*)$")


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The file of a dotted module name under `root` (`a/b.py` or `a/b/__init__.py`), or None."""
    base = root / module.replace(".", "/")
    for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks (their `else` branches run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The project modules the file at `path` imports at run time, anywhere in it (function-level imports too)."""
    stat = path.stat()
    return set(_imported_modules(path, root, stat.st_mtime_ns, stat.st_size))


@functools.cache
def _imported_modules(path: Path, root: Path, mtime_ns: int, size: int) -> frozenset[str]:
    """`imported_modules`, parsed once per version of the file (the walk visits a module from every stage)."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise ValueError(f"{path}: a relative import; the project imports absolutely")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}", root))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PROJECT_PACKAGES)
    return frozenset(out)


def import_closure(stage: str, root: Path = ROOT) -> set[Path]:
    """Every project file `python -m stages.<stage>` imports (relative to `root`), each package's `__init__.py`
    included."""
    return module_closure(f"stages.{stage}", root)


def copied_files(stage: str, root: Path = ROOT) -> set[Path]:
    """What `stage` copies besides what it imports (`COPIES`): each copied module's import closure, packages'
    `__init__.py` included (the copy must import), and the files those modules read (`READS`)."""
    files = {f for module in COPIES.get(stage, ()) for f in module_closure(module, root)}
    return files | {Path(r) for f in files for r in READS.get(f.as_posix(), ())}


def module_closure(entry: str, root: Path = ROOT) -> set[Path]:
    """Every project file importing module `entry` runs (relative to `root`), each package's `__init__.py`
    included."""
    seen: set[str] = set()
    todo = [entry]
    files: set[Path] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(module, root)
        if path is None:
            continue
        files.add(path.relative_to(root))
        todo.extend(imported_modules(path, root))
        parent = module.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return files


def is_marker(path: Path, root: Path = ROOT) -> bool:
    """A package `__init__.py` that holds no code (a docstring and constants at most): nothing a stage runs."""
    if path.name != "__init__.py":
        return False
    body = ast.parse((root / path).read_text()).body
    return all(isinstance(n, ast.Expr | ast.Assign) and isinstance(getattr(n, "value", None), ast.Constant)
               for n in body)


def is_code_dep(dep: str) -> bool:
    """Whether a `dvc.yaml` dep names project code (rewritten by `--write`) rather than data."""
    return dep.split("/")[0] in PROJECT_PACKAGES


def code_deps(stage: str, root: Path = ROOT) -> list[str]:
    """The code deps `dvc.yaml` should list for `stage`, sorted: its import closure without marker `__init__.py`
    files, the files its modules read (`READS`) and what it copies (`COPIES`); an entry inside a directory the list
    already holds is left out."""
    modules = {p.as_posix() for p in import_closure(stage, root) | copied_files(stage, root) if not is_marker(p, root)}
    deps = modules | {f for m in modules for f in READS.get(m, ())}
    dirs = {d for d in deps if (root / d).is_dir()}
    return sorted(d for d in deps if not any(d.startswith(f"{parent}/") for parent in dirs))


def _stage_names(text: str) -> list[str]:
    import yaml

    return list(yaml.safe_load(text)["stages"])


def rewrite(text: str, root: Path = ROOT) -> str:
    """`dvc.yaml`'s text with each stage's code deps replaced by `code_deps(stage)`: the data deps stay first, in
    their order, then the code deps; lines, comments and formatting elsewhere are kept byte for byte."""
    wanted = {stage: code_deps(stage, root) for stage in _stage_names(text)}
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    stage: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        header = re.match(r"^  (\w[\w-]*):\s*$", line)
        if header:
            stage = header.group(1)
        out.append(line)
        i += 1
        if stage is None or not re.match(r"^    deps:\s*$", line):
            continue
        items: list[re.Match[str]] = []
        while i < len(lines) and (m := _DEP_LINE.match(lines[i].rstrip("\n"))) and len(m["indent"]) > 4:
            items.append(m)
            i += 1
        if not items:
            raise ValueError(f"stage {stage}: its deps are not a block list of `- path` lines")
        indent = items[0]["indent"]
        kept = {m["value"]: m.group(0) for m in items if is_code_dep(m["value"])}
        out.extend(m.group(0) + "\n" for m in items if not is_code_dep(m["value"]))
        out.extend(kept.get(dep, f"{indent}- {dep}") + "\n" for dep in wanted.pop(stage))
    if wanted:
        raise ValueError(f"stages without a `deps:` list in dvc.yaml: {sorted(wanted)}")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.core.stage_deps", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1, with a diff, where dvc.yaml's code deps differ")
    mode.add_argument("--write", action="store_true", help="rewrite dvc.yaml's code deps in place")
    parser.add_argument("--dvc-yaml", type=Path, default=ROOT / "dvc.yaml", help="the file (default: %(default)s)")
    args = parser.parse_args(argv)
    path: Path = args.dvc_yaml
    root = path.resolve().parent
    text = path.read_text()
    new = rewrite(text, root)
    if args.write:
        if new != text:
            from pipeline.core.io import replaced_on_success

            with replaced_on_success(path) as tmp:  # a killed rewrite leaves the old dvc.yaml, never half of one
                tmp.write_text(new)
        print(f"{path}: {'rewritten' if new != text else 'unchanged'}")
        return 0
    if new != text:
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                                   str(path), f"{path} (from the import graph)"))
        print(f"{path}: code deps differ from the import graph; run `python -m pipeline.core.stage_deps --write`")
        return 1
    print(f"{path}: code deps match the import graph")
    return 0


if __name__ == "__main__":
    sys.exit(main())
