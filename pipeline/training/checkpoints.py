"""A training job's checkpoint directory (`CheckpointStore`: `<train.checkpoint_dir>/<job>/`), the decision to
resume from it or start fresh (`ResumePlan`), atomic checkpoint writes, and the attempt's record in MLflow."""

from __future__ import annotations

import json
import logging
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pipeline.core.errors import UserError
from pipeline.core.io import replaced_on_success, write_json
from pipeline.data.batching import LoaderPosition
from pipeline.training.elastic import is_rank_zero
from pipeline.training.fingerprint import Fingerprint
from pipeline.training.resume import PeriodicCheckpoint, ResumableTraining

if TYPE_CHECKING:
    from pipeline.core.params import TrainParams
    from pipeline.core.tracking import StageRun

log = logging.getLogger(__name__)

_STEP = re.compile(r"step=(\d+)")


@dataclass(frozen=True)
class ResumePlan:
    """How a job starts: from `checkpoint` (at optimizer step `step`) or fresh, and why, in one line."""

    job: str
    checkpoint: Path | None
    step: int
    reason: str
    # the MLflow run of the job's previous attempt: resumed, this attempt continues its curves; fresh, it is
    # closed if a killed process left it RUNNING
    previous_run_id: str | None = None

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

    @property
    def ckpt_path(self) -> str | None:
        """For `trainer.fit(ckpt_path=...)`."""
        return str(self.checkpoint) if self.checkpoint is not None else None

    def record(self) -> dict[str, Any]:
        """For `metrics/*.json` and MLflow: whether it resumed, from which step, and why (not)."""
        return {"resumed": self.resumed, "resumed_from_step": self.step, "resume_reason": self.reason}


class CheckpointStoreError(UserError):
    """A job's checkpoint directory could not be put in the state its plan needs."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, but through a temporary file renamed into place: a checkpoint file is whole
    or absent, whenever the process dies."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        with replaced_on_success(Path(path)) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


class CheckpointStore:
    """`<root>/<job>/`: the job's fingerprint, the MLflow run of its last attempt, and its checkpoints
    (`periodic/`, `best/`, `preempt-step=N.ckpt`). Only rank 0 changes it; other ranks read the same decision."""

    FINGERPRINT = "fingerprint.json"
    RUN = "run.json"

    def __init__(self, root: Path, job: str, every_n_steps: int = 0, writer: bool | None = None) -> None:
        self.dir = Path(root) / job
        self.job = job
        self.every_n_steps = every_n_steps
        self.writer = is_rank_zero() if writer is None else writer

    @classmethod
    def for_job(cls, train: TrainParams, job: str) -> CheckpointStore:
        """The store of `job` as `train` places and paces it."""
        return cls(Path(train.checkpoint_dir), job, train.checkpoint_every_n_steps)

    @property
    def best_dir(self) -> Path:
        return self.dir / "best"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Intact resume points (periodic and preempted checkpoints), newest step first (a torch checkpoint is a zip:
        a cut-off one is not). Not `best/`: the best checkpoint is written where the validation ends, which at an
        epoch's end is not a point a run resumes from exactly (`resume.PeriodicCheckpoint`)."""
        found = []
        candidates = [*self.dir.glob("periodic/*.ckpt"), *self.dir.glob("preempt-*.ckpt")] if self.dir.is_dir() else []
        for p in candidates:
            m = _STEP.search(p.name)
            try:  # a file rank 0 removes meanwhile (its fresh start's `clear`) is no resume point
                if m and zipfile.is_zipfile(p):
                    found.append((int(m.group(1)), p.stat().st_mtime, p))
            except FileNotFoundError:
                continue
        return [(step, p) for step, _, p in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]

    def plan(self, current: Fingerprint, resume: bool = True) -> ResumePlan:
        """Resume from the newest intact checkpoint if the saved fingerprint equals `current`; otherwise clear the
        directory (rank 0) and start fresh. The reason is logged and returned, with the previous attempt's MLflow
        run either way (read before the directory is cleared: `start_attempt` closes it)."""
        saved = self._read_fingerprint()
        found = self.checkpoints()
        previous = self._read_run()
        if not resume:
            plan = ResumePlan(self.job, None, 0, "fresh start: train.resume is false", previous)
        elif not found:
            plan = ResumePlan(self.job, None, 0, f"fresh start: no checkpoint in {self.dir}", previous)
        elif saved is None:
            plan = ResumePlan(self.job, None, 0, f"fresh start: {self.dir} has checkpoints but no fingerprint",
                              previous)
        elif changed := current.differences(saved):
            plan = ResumePlan(self.job, None, 0, f"fresh start, the checkpoint at step {found[0][0]} is for other "
                                                 f"inputs: {'; '.join(changed)}", previous)
        else:
            step, path = found[0]
            plan = ResumePlan(self.job, path, step, f"resuming from step {step} ({path})", previous)
        if not plan.resumed and self.writer:
            self.clear()
        if self.writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.dir / self.FINGERPRINT, asdict(current))
        log.info("%s: %s", self.job, plan.reason)
        return plan

    def remember_run(self, run_id: str) -> None:
        """The MLflow run of this attempt: a later resumed attempt continues its curves."""
        if self.writer:
            write_json(self.dir / self.RUN, {"mlflow_run_id": run_id})

    def clear(self) -> None:
        """Remove the job's checkpoints (rank 0): called when the job has finished and on a fresh start. A
        checkpoint that could not be removed is an error: the fresh start's fingerprint, written next, would
        vouch for a checkpoint of the other trajectory."""
        if self.writer and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
            if left := self.checkpoints():
                raise CheckpointStoreError(f"{self.job}: could not remove {left[0][1]} (and {len(left) - 1} more); "
                                           f"remove {self.dir} and run again")

    def callbacks(self, position: LoaderPosition | None = None) -> list[L.Callback]:
        """Periodic checkpoints (if `every_n_steps`) and the resume/signal handling, for a Trainer's callbacks."""
        out: list[L.Callback] = [ResumableTraining(self.dir, position)]
        if self.every_n_steps:
            out.insert(0, PeriodicCheckpoint(self.dir / "periodic", self.every_n_steps))
        return out

    def _read_fingerprint(self) -> Fingerprint | None:
        try:
            raw = json.loads((self.dir / self.FINGERPRINT).read_text())
            return Fingerprint(raw["settings"], raw["data"], raw["code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _read_run(self) -> str | None:
        try:
            return str(json.loads((self.dir / self.RUN).read_text())["mlflow_run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def start_attempt(run: StageRun, plan: ResumePlan, store: CheckpointStore) -> None:
    """Record the attempt in its MLflow run: whether it resumed and from where (tags), the previous attempt (the
    interrupted one it continues, or the one a fresh start replaces), closed as KILLED if a killed process left it
    RUNNING, and this run as the one a later attempt would continue."""
    run.set_tags({"resume.resumed": str(plan.resumed).lower(), "resume.reason": plan.reason[:500],
                  "resume.from_step": str(plan.step)})
    if plan.previous_run_id and plan.resumed:
        run.close_interrupted(plan.previous_run_id)
    elif plan.previous_run_id:
        run.close_replaced(plan.previous_run_id)
    store.remember_run(run.run_id)
