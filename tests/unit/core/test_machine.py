"""Unit: the machine record a benchmark figure carries (ISA flags as this CPU reports them, threads used)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.core.machine import machine_info


def _cpuinfo_flags() -> set[str]:
    """The CPU's flags as the kernel lists them, read here independently of `machine_info`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line (not an x86 CPU)")


def test_machine_info_records_this_cpus_isa_flags_and_the_threads_used():
    flags = _cpuinfo_flags()
    info = machine_info(threads=3)
    assert info["threads_used"] == 3
    assert info["logical_cpus"] == os.cpu_count()
    # the flags that decide INT8 and bf16 speed are all reported, each as this CPU has it or not
    assert {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"} <= set(info["isa"])
    assert info["isa"] == {flag: flag in flags for flag in info["isa"]}
