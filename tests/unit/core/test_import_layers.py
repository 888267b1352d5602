"""`pipeline/` imports one way: every module is parsed with `ast` (function-level and TYPE_CHECKING imports
included), and the graph of project imports has no circle and no import from a lower layer into a higher one."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

#: Bottom to top. A module may import its own layer and the layers below it, never one above.
LAYERS: tuple[str, ...] = (
    "pipeline.core",        # settings, I/O, machine facts, tracking, stage plumbing, errors
    "pipeline.data",        # IMDB, splits, tokens, batching
    "pipeline.modeling",    # where models come from and their architectures
    "pipeline.runtimes",    # running any built variant; the variant catalog and records
    "pipeline.surgery",     # pruning, the distillation student and losses, QAT's fake quantizers
    "pipeline.training",    # finetune, distill and QAT training loops
    "pipeline.variants",    # the builders of each variant
    "pipeline.selection",   # which variants meet the targets, which one is served
    "pipeline.deployment",  # the served predictor, protocol and archive
    "pipeline.evaluation",  # accuracy, latency, the report
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "pipeline").rglob("*.py"))}


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    out.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the project imports absolutely")
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
        graph[name] = out - {name}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import circle (as a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    for i, prefix in enumerate(layers):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def upward_imports(graph: Mapping[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[str]:
    out = []
    for module, imported in sorted(graph.items()):
        low = layer_of(module, layers)
        for target in sorted(imported):
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                out.append(f"{module} imports {target} ({layers[low]} is below {layers[high]})")
    return out


def test_the_checker_finds_a_circle_and_an_upward_import():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "b.w": set()}
    assert find_cycle(graph) == ["a.x", "a.y", "a.z", "a.x"]
    assert find_cycle({"a.x": {"a.y"}, "a.y": set()}) is None
    assert upward_imports({"lo.m": {"hi.n"}, "hi.n": {"lo.m"}}, ("lo", "hi")) == ["lo.m imports hi.n (lo is below hi)"]


def test_the_graph_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from pipeline.core import io\n    import pipeline.core.params\n")
    graph = import_graph({"m": module, "pipeline.core": module, "pipeline.core.io": module,
                          "pipeline.core.params": module})
    assert graph["m"] == {"pipeline.core.io", "pipeline.core.params"}


def test_every_pipeline_package_has_a_layer():
    packages = {m for m, p in project_modules().items() if m.count(".") == 1}
    assert {p for p in packages if layer_of(p) is None} == set()


def test_no_import_circle_inside_pipeline():
    cycle = find_cycle(import_graph(project_modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports(import_graph(project_modules())) == []


@pytest.mark.parametrize("layer", ["pipeline.runtimes", "pipeline.surgery", "pipeline.training"])
def test_lower_layers_import_no_builder(layer):
    graph = import_graph(project_modules())
    builders = {t for m, ts in graph.items() if layer_of(m) == LAYERS.index(layer) for t in ts
                if t.startswith("pipeline.variants")}
    assert builders == set()


#: Modules allowed past the size limit, with the reason (the limit keeps one job per module).
OVERSIZE: dict[str, str] = {}  # module -> why it may exceed MAX_LINES (none today)
MAX_LINES = 330  # "about 300 lines" (issue 36)


def test_every_module_says_what_its_one_job_is_and_stays_small():
    """Every module of `pipeline/`, the servers (`serving/`), the stages' entry points (`stages/`) and `benchmarks/`."""
    undocumented, oversize = [], []
    others = {module_name(p): p for folder in ("serving", "stages", "benchmarks")
              for p in sorted((ROOT / folder).rglob("*.py"))}
    for name, path in {**project_modules(), **others}.items():
        text = path.read_text()
        if not ast.get_docstring(ast.parse(text)):
            undocumented.append(name)
        if len(text.splitlines()) > MAX_LINES and name not in OVERSIZE:
            oversize.append(f"{name}: {len(text.splitlines())} lines")
    assert undocumented == [] and oversize == []
