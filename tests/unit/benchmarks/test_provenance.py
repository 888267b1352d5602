"""Unit: every benchmark's JSON says where its figures come from (`benchmarks.provenance`): the command as typed,
quoted so it pastes back, the UTC date, and the CPU with its ISA flags."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest

from benchmarks.provenance import command_line, provenance, utc_minute

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def test_the_command_is_the_module_and_its_arguments_quoted_to_paste_back():
    argv = ["--variants", "int8-qat,int8 static", "--out", "a b.json", "--concurrency", "1,8"]
    line = command_line("benchmarks.serve_load", argv)
    assert shlex.split(line) == ["python", "-m", "benchmarks.serve_load", *argv]


def test_an_empty_argument_list_is_the_bare_command_not_the_test_runners_arguments():
    assert command_line("benchmarks.onnx_ab", []) == "python -m benchmarks.onnx_ab"


def test_the_date_is_utc_to_the_minute():
    assert utc_minute(0) == "1970-01-01 00:00 UTC"
    assert provenance("benchmarks.x", [], at=86_400 + 61)["date"] == "1970-01-02 00:01 UTC"


@pytest.mark.parametrize("threads", [None, 2])
def test_the_machine_names_the_cpu_and_the_isa_flags_int8_and_bf16_depend_on(threads):
    machine = provenance("benchmarks.x", [], threads=threads)["machine"]
    assert machine["cpu"] and {"avx2", "avx512_vnni", "avx512_bf16"} <= set(machine["isa"])
    assert ("threads_used" in machine) == (threads is not None)


def _writes_results(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "write_json"
               for n in ast.walk(tree))


def _names_used(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_every_benchmark_that_writes_results_records_them_through_provenance(path):
    """A benchmark that writes a JSON of figures builds its command, date and machine with `provenance` (or, for
    a file that keeps its own field names, `command_line`), so none writes figures without them."""
    tree = ast.parse(path.read_text(), str(path))
    if path.stem == "provenance" or not _writes_results(tree):
        return
    assert _names_used(tree) & {"provenance", "command_line"}, f"{path.name} writes results without provenance"


def test_every_result_file_records_its_command_and_date_or_is_listed_as_older_than_that():
    """New results carry their provenance; the files written before it are listed, with what is known of each, in
    benchmarks/results/README.md, and that list names only files that are there and do lack it."""
    import json
    import re

    results = BENCHMARKS / "results"
    listed = set(re.findall(r"^\| `([^`]+\.json)` \|", (results / "README.md").read_text(), flags=re.M))
    lacking = set()
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        if not ("command" in record and ("date" in record or "date_utc" in record)):
            lacking.add(path.name)
    assert lacking - listed == set(), "results without command and date (record them: benchmarks.provenance)"
    assert listed - lacking == set(), "listed as lacking provenance but carrying it (or not there): unlist them"
