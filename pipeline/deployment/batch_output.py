"""Where batch scoring (`pipeline.deployment.batch_scoring`) writes its answers, and when they become the output: a
local output is written by Spark under a hidden folder beside it (`staged_output`: the same parent, so that the
last step is one rename on one file system) and moved onto OUTPUT only once its rows were counted
(`StagedOutput.commit`). A run that is killed, interrupted or fails its count leaves OUTPUT as it was (absent, or
the earlier output `--overwrite` would have replaced), never a folder of some part files and no `_SUCCESS`, which
pandas reads as fewer rows (or none) without an error. Other file systems (`hdfs://`, `s3a://`) and a cluster's
plain paths are written in place, as Spark does: there `_SUCCESS` marks a complete output."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.deployment.batch_failures import signals_deferred
from pipeline.deployment.batch_inputs import local_path

#: What the hidden folders beside OUTPUT are called, after `.<OUTPUT's name>`: Spark writes into the first (into a
#: folder named as OUTPUT inside it, so that the format goes by the same name and Spark, which warns of a hidden
#: folder it is given, reads back one that is not), and an earlier output that `--overwrite` replaces is moved to
#: the second for the moment of the swap. Both begin with a dot, so Spark and the input checks skip them where the
#: parent folder is read as an input.
STAGING_SUFFIX, REPLACED_SUFFIX = ".scoring-", ".replaced-"


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
                replaced = self.output.with_name(f".{self.output.name}{REPLACED_SUFFIX}{os.getpid()}")
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

    def discard(self) -> None:
        """Delete the staging folder with what is still in it (nothing once committed); what cannot be deleted
        stays, hidden."""
        shutil.rmtree(self.holder, ignore_errors=True)


def staged_output(output_path: str, *, local_master: bool) -> StagedOutput | None:
    """The staging of a local output (`batch_inputs.local_path`): `.<name>.scoring-<pid>/<name>` beside it, emptied
    of what a killed run of the same process id left there; None for an output written in place."""
    output = local_path(output_path, local_master=local_master)
    if output is None:
        return None
    output = Path(os.path.abspath(output))
    staged = StagedOutput(holder=output.with_name(f".{output.name}{STAGING_SUFFIX}{os.getpid()}"), output=output)
    staged.discard()
    return staged
