"""Unit: how a batch-scoring run stops on a signal (`pipeline.deployment.batch_failures.StopOnSignals`), without
Spark. Each case runs in a process of its own, as the command does: a signal that nothing handled would end the test
worker instead of failing the test. The whole command, Spark's write included, is stopped by SIGINT in
tests/unit/deployment/test_batch_scoring.py (SIGTERM there too under `make test-all`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.factories import ROOT

#: Installs the handlers, sends this process the signal, and prints what reached the main thread; then, inside
#: `deferred`, sends it twice: the first waits for the block, the second exits at once.
SCRIPT = """
import os, signal, sys, time
from pipeline.deployment.batch_failures import Interrupted, StopOnSignals
signum = int(sys.argv[1])
before = signal.getsignal(signum)
stop = StopOnSignals()
stop.install()
try:
    os.kill(os.getpid(), signum)
    time.sleep(5)
    print("not interrupted")
except Interrupted as exc:
    print("interrupted", exc.signum)
finally:
    stop.restore()
print("restored", signal.getsignal(signum) == before)
stop = StopOnSignals()
stop.install()
with stop.deferred():
    os.kill(os.getpid(), signum)
    time.sleep(0.2)
    print("deferred", stop.received, flush=True)
    os.kill(os.getpid(), signum)
    time.sleep(5)
print("not exited")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_interrupts_the_main_thread_and_a_second_one_exits_with_the_shells_status(signum):
    """The first signal raises `Interrupted` in the main thread (SIGTERM's default would have killed the process
    where it stood), `restore` puts the earlier handler back, a signal inside `deferred` waits for the block, and a
    second signal exits at once with 128 + its number and one line."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(int(signum))], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    name = signal.Signals(signum).name
    assert done.returncode == 128 + signum, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == [f"interrupted {int(signum)}", "restored True", f"deferred {int(signum)}"]
    assert "not " not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == f"{name} again: exiting at once"
