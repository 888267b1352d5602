"""A command's process ends without the interpreter's last garbage collection.

When a Python process exits, after the atexit handlers, the interpreter clears every module and collects the
garbage of the whole object graph once more. In a stage that has imported torch, transformers, onnxruntime and
MLflow that graph holds millions of objects, and the collection costs seconds per process, after its work is done,
paid by each of the pipeline's stage processes and memory probes (the measurement: docs/testing.md).
`gc.freeze()` run as the last atexit handler moves every object into the permanent generation, which collections
skip; everything else about exiting is unchanged: the atexit handlers (MLflow's flushes, logging's shutdown) have
run, modules are still cleared and objects freed by reference count (files closed and flushed), threads joined.
Only garbage in reference cycles at exit is left to the operating system, as `__del__` at exit never was promised.
"""

from __future__ import annotations

import atexit
import gc


def skip_final_collection() -> None:
    """Freeze the garbage collector when the process exits, after the atexit handlers registered from now on (they
    run last-in, first-out). For a process's main command only, never for code called inside a longer-lived
    process (a test session, a server) that goes on collecting."""
    atexit.register(gc.freeze)
