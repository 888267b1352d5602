"""Elastic launch of the finetune stage (`train.launcher: torchrun`): the stage re-runs itself under
`torch.distributed.run` (torchelastic) with a c10d rendezvous, so a group of `min_nodes`..`num_nodes` machines with
`devices` processes each trains together, and a failed worker restarts the whole group (up to `max_restarts`
times), which resumes from the newest checkpoint (`pipeline.training.resume`). Lightning reads the group's shape from
torchelastic's environment (`classifier.elastic_world`); the backend is gloo on CPU and NCCL on CUDA."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence

from pipeline.core.params import TrainParams

log = logging.getLogger(__name__)


def under_torchelastic() -> bool:
    """True in a worker that torchrun started (its agent sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_command(train: TrainParams, program: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run ...` running `program` (e.g. `-m stages.finetune --params ...`)."""
    nodes = str(train.num_nodes)
    if train.min_nodes is not None and train.min_nodes != train.num_nodes:
        nodes = f"{train.min_nodes}:{train.num_nodes}"
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={train.devices}",
            f"--max-restarts={train.max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={train.rdzv_endpoint}",
            f"--rdzv-id={train.rdzv_id}", *program]


def launch(train: TrainParams, program: Sequence[str]) -> int:
    """Run `program` under torchrun as `train` says and return its exit status (the agent's: 0 once the group
    finished, non-zero when it failed more than `max_restarts` times)."""
    cmd = torchrun_command(train, program)
    log.info("elastic launch: %s", " ".join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, env=env, check=False).returncode
