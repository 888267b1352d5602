"""Unit: `pipeline.core.process_identity` tells a stage run whose process has ended from one whose process may still
run (the orphan cleanup closes only the first): a dead process id, another boot and a reused id (same id, another
start time) have ended; this process, another host and another pid namespace (another container, whose ids mean
nothing here) may still run, and so may a process of another user; a run tagged before the boot, namespace and
start time were recorded is judged by host and id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.core import process_identity as pi


def _dead_pid() -> str:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="boot id, pid namespace and start time are Linux's")
def test_a_process_has_ended_only_where_this_machine_can_be_sure():
    here = pi.current()
    assert set(here) == {pi.HOST_TAG, pi.PID_TAG, pi.BOOT_TAG, pi.PID_NAMESPACE_TAG, pi.STARTED_TAG}
    assert here[pi.PID_TAG] == str(os.getpid()) and here[pi.PID_NAMESPACE_TAG].startswith("pid:[")
    assert not pi.has_ended(here)
    assert pi.has_ended({**here, pi.PID_TAG: _dead_pid()})
    assert pi.has_ended({**here, pi.BOOT_TAG: "another-boot"})  # even with this very pid
    assert pi.has_ended({**here, pi.STARTED_TAG: str(int(here[pi.STARTED_TAG]) + 1)})  # the id was reused
    assert not pi.has_ended({**here, pi.HOST_TAG: "another-host", pi.PID_TAG: _dead_pid()})
    assert not pi.has_ended({**here, pi.PID_NAMESPACE_TAG: "pid:[1]", pi.PID_TAG: _dead_pid()})
    assert not pi.has_ended({**here, pi.PID_TAG: "not-a-pid"}) and not pi.has_ended({**here, pi.PID_TAG: "0"})
    # what a run tagged by the code before these tags carries: host and id
    old = {pi.HOST_TAG: here[pi.HOST_TAG], pi.PID_TAG: here[pi.PID_TAG]}
    assert not pi.has_ended(old) and pi.has_ended({**old, pi.PID_TAG: _dead_pid()})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_process_of_another_user_is_judged_by_its_start_time():
    """Process 1 (init) runs as root: signalling it is refused (or allowed, as root), and only a start time that
    differs says the id was reused."""
    init = {**pi.current(), pi.PID_TAG: "1"}
    init.pop(pi.STARTED_TAG)
    assert not pi.has_ended(init)
    started = pi.start_time(1)
    if started:
        assert not pi.has_ended({**init, pi.STARTED_TAG: started})
        assert pi.has_ended({**init, pi.STARTED_TAG: str(int(started) + 1)})


def test_the_start_time_survives_a_command_name_with_spaces_and_parentheses(tmp_path):
    """`/proc/<pid>/stat` puts the command name in parentheses, and the name may hold both: the fields are counted
    from the last `)`."""
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    odd = tmp_path / "a) (b c"
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            assert ") (b" in f.read()  # the name as the kernel shows it (cut to 15 characters)
        assert pi.start_time(proc.pid).isdigit()
    finally:
        proc.communicate(b"")
