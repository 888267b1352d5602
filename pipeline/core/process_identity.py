"""Which process a stage run belongs to, and whether that process has ended, told from the tags it wrote.

A stage killed by SIGKILL (or by the machine going down) leaves its MLflow run RUNNING; the next stage process ends
such runs (`pipeline.core.parent_run.close_orphaned_runs`) once it is sure their process is gone. A host name and a
process id alone are not sure: machines and containers can share a host name (default cloud images, CI runners,
`--hostname`, host networking) while each numbers its processes on its own, and after a reboot, or once ids wrap
around, another process can hold the dead one's id. So a run also records the kernel's boot id, the machine id
(`/etc/machine-id`), its pid namespace and its process's start time (Linux; elsewhere they are missing, and the
check falls back to host name and id):

- the same machine (same machine id) booted since: the process has ended;
- another boot id without the same machine id (another machine with this host name, as far as anyone can tell):
  nothing is concluded, the run is left alone;
- another pid namespace (another container): its process ids mean nothing here, nothing is concluded;
- same boot and namespace, and no process with that id, or one that started at another time (the id was reused):
  the process has ended.

What stays uncertain is left alone: a run whose process cannot be proven dead stays RUNNING (and its unfinished
registered version stays) rather than a live stage elsewhere losing its run. Runs of containers, each in a pid
namespace of its own, are therefore closed only by a later stage in the same container; images that bake in one
machine id and share a host name across machines defeat the reboot rule (systemd asks images to ship the file
empty).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

HOST_TAG, PID_TAG = "pipeline.host", "pipeline.pid"
BOOT_TAG, PID_NAMESPACE_TAG, STARTED_TAG = "pipeline.boot_id", "pipeline.pid_namespace", "pipeline.process_started"
MACHINE_TAG = "pipeline.machine_id"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """The kernel's id of this boot (Linux; empty elsewhere)."""
    return _read("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """This machine's id (`/etc/machine-id`, systemd's; D-Bus's copy where that is missing; empty elsewhere)."""
    return _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")


def pid_namespace() -> str:
    """This process's pid namespace, as `pid:[inode]` (Linux; empty elsewhere)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def start_time(pid: int) -> str:
    """When process `pid` started, in clock ticks after boot (field 22 of `/proc/<pid>/stat`); empty where it cannot
    be read (no such process, not Linux). The command name (field 2) may hold spaces and parentheses, so the fields
    are counted from the last `)`."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 1:].split()
    return fields[19] if len(fields) > 19 else ""


def current() -> dict[str, str]:
    """This process's identity as run tags (those this system cannot tell left out)."""
    pid = os.getpid()
    tags = {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), BOOT_TAG: boot_id(), MACHINE_TAG: machine_id(),
            PID_NAMESPACE_TAG: pid_namespace(), STARTED_TAG: start_time(pid)}
    return {key: value for key, value in tags.items() if value}


def _differ(tags: Mapping[str, str], here: Mapping[str, str], key: str) -> bool:
    """Both sides know `key`, and it differs."""
    return bool(tags.get(key)) and bool(here.get(key)) and tags[key] != here[key]


def has_ended(tags: Mapping[str, str], here: Mapping[str, str] | None = None) -> bool:
    """Whether the process that wrote identity `tags` (`current()`) has certainly ended. False whenever this process
    cannot tell: another host, another machine or container with this host name, an id it may not signal, tags it
    cannot read, a run tagged without the boot id where this system has one (written by older code or another OS).
    On Windows always False (`os.kill(pid, 0)` would send a Ctrl-C event there, not probe). `here`: this process's
    `current()`, where the caller judges several runs and has read it once."""
    here = current() if here is None else here
    if os.name == "nt" or not here.get(HOST_TAG) or tags.get(HOST_TAG) != here[HOST_TAG]:
        return False
    if here.get(BOOT_TAG) and not tags.get(BOOT_TAG):
        return False  # no boot id to tell this machine from another one with the same host name
    if _differ(tags, here, BOOT_TAG):
        # this machine rebooted since (no process of that boot runs), or another machine: only the machine id tells
        return bool(tags.get(MACHINE_TAG)) and tags.get(MACHINE_TAG) == here.get(MACHINE_TAG)
    if _differ(tags, here, PID_NAMESPACE_TAG):
        return False  # a process in another namespace (another container): its id says nothing here
    try:
        pid = int(tags.get(PID_TAG, ""))
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user holds the id: whether it is the same one is decided by its start time
    started = tags.get(STARTED_TAG)
    return bool(started) and start_time(pid) not in ("", started)
