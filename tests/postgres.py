"""A throwaway PostgreSQL cluster for the tests of a team's tracking server on PostgreSQL
(tests/e2e/test_tracking_server.py): Debian's PostgreSQL found where its package keeps it, a cluster started on a
free loopback port in a private directory, and removed afterwards."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from serving.local_servers import free_port


def postgres_bin_dir() -> Path | None:
    """The directory of PostgreSQL's programs (initdb, pg_ctl, postgres, psql): `initdb` on PATH (its real
    directory), else the newest of Debian's /usr/lib/postgresql/<major>/bin, which the package keeps off PATH; None
    where PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    debian = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb") if p.parent.parent.name.isdigit()]
    return max(debian, key=lambda d: int(d.parent.name)) if debian else None


@contextmanager
def postgres_cluster(bin_dir: Path) -> Iterator[dict[str, Any]]:
    """A throwaway PostgreSQL cluster, stopped and removed on exit even when the body fails: `initdb` into a new
    temporary directory, the server on a free loopback port. Over TCP every role signs in with its password
    (scram-sha-256); on the cluster's own unix socket (in that directory) the superuser `postgres` is trusted, as
    `sudo -u postgres psql` is on a Debian host. Yields `host`, `port`, `socket_dir` and `superuser`.

    PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user (else `nobody`), its
    directory is chowned to it and its programs run through `runuser`."""
    as_user: list[str] = []
    owner = None
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            try:
                owner = pwd.getpwnam(name)
                break
            except KeyError:
                continue
        if owner is None or not shutil.which("runuser"):
            raise RuntimeError("running as root with neither a `postgres` nor a `nobody` user, or without runuser: "
                               "PostgreSQL refuses to run as root")
        as_user = ["runuser", "-u", owner.pw_name, "--"]
    # not under pytest's tmp_path: its directories are private to the user running the tests
    root = Path(tempfile.mkdtemp(prefix="postgres-"))
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    data, log, port = root / "data", root / "postgres.log", free_port()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*as_user, str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                              timeout=120, check=False)

    try:
        init = run("initdb", "-D", str(data), "-U", "postgres", "-E", "UTF8", "--no-sync",
                   "--auth-host=scram-sha-256", "--auth-local=trust")
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {init.stdout[-2000:]}{init.stderr[-2000:]}")
        # durability off: a test's cluster is thrown away, and fsync per commit would dominate MLflow's writes
        server_options = (f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c synchronous_commit=off "
                          "-c full_page_writes=off")
        start = run("pg_ctl", "start", "-w", "-t", "60", "-D", str(data), "-l", str(log), "-o", server_options)
        if start.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"postgres did not start: {start.stdout[-1000:]}{start.stderr[-1000:]}\n{tail}")
        yield {"host": "127.0.0.1", "port": port, "socket_dir": root, "superuser": "postgres"}
    finally:
        stop = run("pg_ctl", "stop", "-D", str(data), "-m", "immediate", "-w", "-t", "30")
        pid_file = data / "postmaster.pid"
        if stop.returncode != 0 and pid_file.exists():  # pg_ctl could not stop the server it started: end it
            with contextlib.suppress(ProcessLookupError, ValueError, OSError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
