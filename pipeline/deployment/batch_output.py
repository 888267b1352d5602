"""Where batch scoring (`pipeline.deployment.batch_scoring`) writes its answers, and when they become the output: a
local output is written by Spark under a hidden folder beside it (`staged_output`: the same parent, so that the
last step is one rename on one file system) and moved onto OUTPUT only once its rows were counted
(`StagedOutput.commit`). A run that is killed, interrupted or fails its count leaves OUTPUT as it was (absent, or
the earlier output `--overwrite` would have replaced), never a folder of some part files and no `_SUCCESS`, which
pandas reads as fewer rows (or none) without an error. Other file systems (`hdfs://`, `s3a://`) and a cluster's
plain paths are written in place, as Spark does: there `_SUCCESS` marks a complete output. A run killed outright
(SIGKILL, the OOM killer) cannot tidy up: the next run on the same host does (`recover_abandoned`)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from pipeline.core import process_identity
from pipeline.core.io import read_json, write_json
from pipeline.deployment.batch_failures import signals_deferred
from pipeline.deployment.batch_inputs import local_path

#: What the hidden folders beside OUTPUT are called, after `.<OUTPUT's name>` and before `<host>-<pid>` (the run's;
#: `run_tag`): Spark writes into the first (into a folder named as OUTPUT inside it, so that the format goes by the
#: same name and Spark, which warns of a hidden folder it is given, reads back one that is not), and an earlier
#: output that `--overwrite` replaces is moved to the second for the moment of the swap. Both begin with a dot, so
#: Spark and the input checks skip them where the parent folder is read as an input.
STAGING_SUFFIX, REPLACED_SUFFIX = ".scoring-", ".replaced-"
#: The file in a staging folder naming the process that writes it (`process_identity.current()`), by which a later
#: run tells whether that process has certainly ended (`recover_abandoned`).
OWNER_FILE = "owner.json"


@dataclass(frozen=True)
class StagedOutput:
    """A local output being written: Spark writes `folder` (in the hidden `holder`), which becomes `output` at
    `commit`."""

    holder: Path
    output: Path

    @property
    def folder(self) -> Path:
        """Where Spark writes: a folder named as the output, in `holder`."""
        return self.holder / self.output.name

    def commit(self, overwrite: bool) -> None:
        """Rename the counted answers onto the output. An earlier output there (`overwrite`; `check_output` checked,
        just before, that it is one) is moved aside first and deleted once the new one is in place; if the rename
        fails it is put back. SIGINT and SIGTERM wait for the swap to end (`signals_deferred`)."""
        with signals_deferred():
            replaced = None
            if self.output.exists() or self.output.is_symlink():
                if not overwrite:
                    raise ValueError(f"{self.output} appeared while the answers were written: run again with "
                                     "--overwrite to replace it, or choose another output")
                replaced = self.output.with_name(f".{self.output.name}{REPLACED_SUFFIX}{run_tag()}")
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(self.output, replaced)
            try:
                os.rename(self.folder, self.output)
            except OSError:
                if replaced is not None:
                    os.rename(replaced, self.output)
                raise
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self.discard()

    def claim(self) -> None:
        """Create the staging folder with this process's identity in it (`OWNER_FILE`), before Spark writes."""
        write_json(self.holder / OWNER_FILE, process_identity.current())

    def discard(self) -> None:
        """Delete the staging folder with what is still in it (nothing once committed); what cannot be deleted
        stays, hidden."""
        shutil.rmtree(self.holder, ignore_errors=True)


def staged_output(output_path: str, *, local_master: bool) -> StagedOutput | None:
    """The staging of a local output (`batch_inputs.local_path`): `.<name>.scoring-<host>-<pid>/<name>` beside it,
    emptied of what a killed run of the same process id left there; None for an output written in place."""
    output = local_path(output_path, local_master=local_master)
    if output is None:
        return None
    output = Path(os.path.abspath(output))
    staged = StagedOutput(holder=output.with_name(f".{output.name}{STAGING_SUFFIX}{run_tag()}"), output=output)
    staged.discard()
    return staged


def run_tag() -> str:
    """`<host>-<pid>` of this run: its hidden folders' names differ from those of a run on another host that shares
    the file system (process ids repeat from host to host)."""
    host = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def recover_abandoned(output_path: str, *, local_master: bool) -> list[str]:
    """Tidy what runs killed outright left beside a local output, and say what was done (one line each). A staging
    folder whose owner (`OWNER_FILE`) has certainly ended (`process_identity.has_ended`: same machine and pid
    namespace, and its process gone or its id reused) is deleted with Spark's part files in it; the earlier output
    that run had moved aside for its swap is put back where OUTPUT is missing (it was killed between the two renames,
    and this is the only copy) and deleted where the swap finished. A folder whose owner may still run, or runs
    elsewhere, or that names none, is left alone."""
    output = local_path(output_path, local_master=local_master)
    if output is None:
        return []
    output = Path(os.path.abspath(output))
    prefix = f".{output.name}{STAGING_SUFFIX}"
    here = process_identity.current()
    said: list[str] = []
    for holder in sorted(output.parent.glob(f"{glob.escape(prefix)}*")):
        try:
            owner = read_json(holder / OWNER_FILE)
        except (OSError, ValueError):
            continue  # no owner named (yet): not this run's to judge
        if not isinstance(owner, dict) or not process_identity.has_ended(owner, here):
            continue
        pid = owner.get(process_identity.PID_TAG, "?")
        replaced = output.with_name(f".{output.name}{REPLACED_SUFFIX}{holder.name[len(prefix):]}")
        try:
            if replaced.exists() and not (output.exists() or output.is_symlink()):
                os.rename(replaced, output)
                said.append(f"put back {output}: a run killed during its swap (process {pid}) had moved it aside "
                            f"to {replaced.name}")
            elif replaced.exists():
                shutil.rmtree(replaced)
                said.append(f"deleted {replaced.name}, the earlier output a killed run (process {pid}) had already "
                            "replaced")
            shutil.rmtree(holder)
        except OSError as exc:
            said.append(f"could not tidy {holder}, left by a killed run (process {pid}): {exc}")
            continue
        said.append(f"deleted {holder.name}, the staging folder of a run that was killed (process {pid} is gone)")
    return said
