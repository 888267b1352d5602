"""Unit: the bytecode list `make test` compiles before its tests (tests/bytecode.py) round-trips, skips what is gone
and compiles what it lists."""

from __future__ import annotations

import sys
from pathlib import Path

from tests import bytecode


def test_the_list_round_trips_and_compiles_what_it_names(tmp_path: Path):
    site = tmp_path / "site"
    (site / "pkg" / "sub").mkdir(parents=True)
    for rel in ("top.py", "pkg/__init__.py", "pkg/used.py", "pkg/unused.py", "pkg/sub/deep.py"):
        (site / rel).write_text("X = 1\n")
    tag = sys.implementation.cache_tag
    for rel in ("top", "pkg/__init__", "pkg/used", "pkg/sub/deep", "pkg/gone"):  # gone: bytecode without a source
        pyc = site / Path(rel).parent / "__pycache__" / f"{Path(rel).name}.{tag}.pyc"
        pyc.parent.mkdir(parents=True, exist_ok=True)
        pyc.write_bytes(b"")
    listed = tmp_path / "list.txt"
    assert bytecode.write_list(listed, site) == 4
    assert "pkg: __init__ used\n" in listed.read_text() and "unused" not in listed.read_text()
    files = bytecode.read_list(listed, site)
    assert sorted(f.relative_to(site).as_posix() for f in files) == ["pkg/__init__.py", "pkg/sub/deep.py",
                                                                      "pkg/used.py", "top.py"]
    (site / "pkg" / "used.py").unlink()  # a stale line is skipped
    assert len(bytecode.read_list(listed, site)) == 3
    for pyc in site.rglob("*.pyc"):
        pyc.unlink()
    assert bytecode.compile_all(bytecode.read_list(listed, site), workers=2)
    assert (site / "pkg" / "sub" / "__pycache__" / f"deep.{tag}.pyc").stat().st_size > 0
    assert not list((site / "pkg" / "__pycache__").glob(f"unused.{tag}.pyc"))


def test_the_committed_list_names_modules_this_venv_has():
    """Most of the list exists here (it was written from this requirements set); a few stale lines are harmless."""
    lines = [ln for ln in bytecode.LIST.read_text().splitlines() if ln and not ln.startswith("#")]
    listed = sum(len(ln.partition(":")[2].split()) for ln in lines)
    assert len(bytecode.read_list(bytecode.LIST, bytecode.site_packages())) > 0.9 * listed
