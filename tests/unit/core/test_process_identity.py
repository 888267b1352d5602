"""Unit: `pipeline.core.process_identity` tells a stage run whose process has ended from one whose process may still
run (the orphan cleanup closes only the first): a dead process id, a reboot of this machine and a reused id (same
id, another start time) have ended; this process, another host, another machine with this host name, another pid
namespace (another container, whose ids mean nothing here) and a run tagged without a boot id may still run, and so
may a process of another user."""

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
    assert {pi.HOST_TAG, pi.PID_TAG, pi.BOOT_TAG, pi.PID_NAMESPACE_TAG, pi.STARTED_TAG} <= set(here)
    assert here[pi.PID_TAG] == str(os.getpid()) and here[pi.PID_NAMESPACE_TAG].startswith("pid:[")
    dead = _dead_pid()
    assert not pi.has_ended(here)
    assert pi.has_ended({**here, pi.PID_TAG: dead})
    assert pi.has_ended({**here, pi.STARTED_TAG: str(int(here[pi.STARTED_TAG]) + 1)})  # the id was reused
    # another boot: this machine rebooted (same machine id, even with this very pid), or another machine
    assert pi.has_ended({**here, pi.BOOT_TAG: "another-boot", pi.MACHINE_TAG: "m1"}) is (here.get(pi.MACHINE_TAG)
                                                                                     == "m1")
    rebooted = {**here, pi.BOOT_TAG: "another-boot"}
    assert pi.has_ended(rebooted) is bool(here.get(pi.MACHINE_TAG))
    assert not pi.has_ended({**rebooted, pi.MACHINE_TAG: "another-machine", pi.PID_TAG: dead})
    assert not pi.has_ended({k: v for k, v in rebooted.items() if k != pi.MACHINE_TAG})
    assert not pi.has_ended({**here, pi.HOST_TAG: "another-host", pi.PID_TAG: dead})
    assert not pi.has_ended({**here, pi.PID_NAMESPACE_TAG: "pid:[1]", pi.PID_TAG: dead})
    assert not pi.has_ended({**here, pi.PID_TAG: "not-a-pid"}) and not pi.has_ended({**here, pi.PID_TAG: "0"})
    # a run tagged by the code before the boot id was recorded: host and id could be another machine's
    assert not pi.has_ended({pi.HOST_TAG: here[pi.HOST_TAG], pi.PID_TAG: dead})


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
        # counted from the first `)` the field would be another one; the child started after this process
        assert int(pi.start_time(proc.pid)) >= int(pi.start_time(os.getpid()))
    finally:
        proc.communicate(b"")
