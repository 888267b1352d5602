"""The machine a figure was measured on: CPU model, ISA flags that decide INT8/bf16 speed, threads, versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model, ISA flags that matter for INT8/bf16, thread settings and library versions."""
    flags: set[str] = set()
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"]
    versions = {}
    for mod in ("torch", "onnxruntime", "onnx", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "absent"
    return {"cpu": model, "logical_cpus": os.cpu_count(), "threads_used": threads,
            "isa": {f: f in flags for f in wanted}, "python": platform.python_version(), "versions": versions}
