"""Unit: a command that skips the interpreter's last collection still exits as any other process does: its exit
status, the atexit handlers registered after it (MLflow's flushes) run first, and an open file is flushed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.factories import ROOT

CHILD = textwrap.dedent("""
    import atexit, gc, sys
    atexit.register(lambda: print("after:", gc.get_freeze_count() > 0, flush=True))  # registered before: runs after
    from pipeline.core.process_exit import skip_final_collection
    skip_final_collection()
    atexit.register(lambda: print("before:", gc.get_freeze_count() == 0, flush=True))
    cycle = []
    cycle.append(cycle)  # garbage of the kind the last collection would have freed
    out = open(sys.argv[1], "w")  # never closed: flushed when the module is cleared
    out.write("x" * 100_000)
    sys.exit(3)
""")


def test_the_process_exits_with_its_status_handlers_and_files_and_the_collector_frozen_last(tmp_path):
    target = tmp_path / "out.txt"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(target)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["before: True", "after: True"]
    assert target.read_text() == "x" * 100_000
