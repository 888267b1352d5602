"""Where a benchmark's figures come from, in the one shape every benchmark's JSON records it: the command as it was
typed (`python -m benchmarks.<name> <arguments>`, quoted so it can be pasted back), the UTC date and minute it
ran, and the machine (CPU model and the ISA flags INT8 and bf16 depend on; with `threads`, also the thread
settings, Python and library versions). RESULTS quotes these three with every figure."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """`python -m <module> <argv>`, shell-quoted; `argv` None: this process's own arguments."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def utc_minute(at: float | None = None) -> str:
    """`at` (a `time.time()`; default now) as `YYYY-MM-DD HH:MM UTC`."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


def provenance(module: str, argv: Sequence[str] | None = None, *, threads: int | None = None,
               at: float | None = None) -> dict[str, Any]:
    """`command`, `date` and `machine` of a run of benchmark `module` with `argv` (None: this process's), dated
    `at` (default: now, as the results are written), using `threads` threads (None: not a timing of thread settings,
    so only the CPU and its flags are recorded)."""
    from pipeline.core.machine import isa_record, machine_info

    machine = (machine_info(threads) if threads is not None
               else {**isa_record(), "logical_cpus": os.cpu_count()})
    return {"command": command_line(module, argv), "date": utc_minute(at), "machine": machine}
