"""Unit: an `OpenVinoRunner` whose first calls come from two threads at once answers both. OpenVINO's Python module
sets up its NumPy API on its first NumPy conversion, under a pybind11 call-once that two threads entering together
can deadlock on with the GIL held: the whole process hangs (the evaluate stage's parallel callers did; without the
set-up, one fresh process in 4 to 16 here). The runner does it in the thread that builds it (`numpy_api_ready`).
The race is once a process, so the test starts fresh processes, each racing two first calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.runtimes.test_options import _identity_onnx

#: One fresh process: build the runner, then two threads make their first calls at the same moment.
RACE = """
import sys, threading
import numpy as np
from pathlib import Path
from pipeline.runtimes import openvino as runtime
runner = runtime.OpenVinoRunner(Path(sys.argv[1]), 2, batching="batched", streams=int(sys.argv[2]))
ids = np.arange(6, dtype=np.int64).reshape(2, 3)
start, out = threading.Barrier(2), [None, None]
def call(i):
    start.wait()
    out[i] = runner(ids, np.ones_like(ids))
threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
assert all(np.array_equal(o, ids.astype(np.float32)) for o in out)
print("answered")
"""

PROCESSES = 8


def _race(ir: Path, streams: int, timeout: float) -> list[str]:
    """How each of `PROCESSES` fresh processes ended: `answered`, or `hung` when it passed `timeout` seconds."""
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(ir), str(streams)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[3])
             for _ in range(PROCESSES)]
    ends = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
            ends.append("answered" if p.returncode == 0 and "answered" in out else f"failed ({p.returncode})")
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            ends.append("hung")
    return ends


@pytest.mark.parametrize("streams", [1, 2])
def test_first_calls_from_two_threads_at_once_are_both_answered(tmp_path, streams):
    """As served (one stream) and as evaluate scores by rows (two streams): every fresh process answers both."""
    import openvino as ov

    ir = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(str(_identity_onnx(tmp_path / "m.onnx"))), str(ir))
    assert _race(ir, streams, timeout=120) == ["answered"] * PROCESSES
