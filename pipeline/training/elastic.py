"""Elastic launch of the finetune stage (`train.launcher: torchrun`): the stage re-runs itself under
`torch.distributed.run` (torchelastic) with a c10d rendezvous, so a group of `min_nodes`..`num_nodes` machines with
`devices` processes each trains together, and a failed worker restarts the whole group (up to `max_restarts`
times), which resumes from the newest checkpoint (`pipeline.training.resume`). Lightning reads the group's shape from
torchelastic's environment (`loop.elastic_world`); the backend is gloo on CPU and NCCL on CUDA. `is_rank_zero` tells,
from the environment alone, the one process of a group (torchrun's or Lightning's DDP) that writes and logs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType

from pipeline.core.params import TrainParams

log = logging.getLogger(__name__)


def under_torchelastic() -> bool:
    """True in a worker that torchrun started (its agent sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def is_rank_zero() -> bool:
    """True in the process that writes files and logs: global rank 0 under torchrun (RANK), else the launching
    process of a Lightning DDP job (LOCAL_RANK and NODE_RANK unset or 0). Read from the environment alone, so a
    stage can tell before it imports any training code."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


#: Signals torchrun's agent passes on to its workers (and stops on) instead of dying of them: its default four and
#: SIGUSR1, a scheduler's preemption notice, on which the workers checkpoint and stop (`resume.STOP_SIGNALS`).
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: Seconds torchrun's agent gives its workers, once it passed a stop signal on, to checkpoint after their next
#: optimizer step (`pipeline.training.resume`) before it SIGKILLs them (its own default: 30).
WORKER_STOP_S = 100


def torchrun_command(train: TrainParams, program: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run ...` running `program` (e.g. `-m stages.finetune --params ...`)."""
    nodes = str(train.num_nodes)
    if train.min_nodes is not None and train.min_nodes != train.num_nodes:
        nodes = f"{train.min_nodes}:{train.num_nodes}"
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={train.devices}",
            f"--max-restarts={train.max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={train.rdzv_endpoint}",
            f"--rdzv-id={train.rdzv_id}", f"--signals-to-handle={AGENT_SIGNALS}",
            f"--shutdown-timeout={WORKER_STOP_S}", *program]


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment: `environ` plus unbuffered worker output and a rendezvous store per round.

    By default the c10d rendezvous shares one TCPStore between the agent and every round of workers, so after a
    restart the keys of the dead round are still there: a new rank 1 can read the old rank 0's gloo address (or
    NCCL unique id) before the new rank 0 overwrites it and fail with "Connection refused", which burns a restart
    each time (pytorch/pytorch#135712). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes each round's rank 0 host a new
    store on a new port; a value the user set is kept."""
    return {**environ, "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")}


class _ExitOnPreemptionNotice:
    """SIGUSR1 (a scheduler's preemption notice, which the workers treat as SIGTERM: `resume.STOP_SIGNALS`) raises
    `SystemExit(128 + SIGUSR1)` in the launcher, so it stops its agent as on SIGTERM. Its default action would end
    the launcher at once and leave the agent and its workers training, orphaned, while a rerun starts a second group
    on the same checkpoints and outputs."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second notice, during the stop, ends the launcher
        raise SystemExit(128 + signum)


def launch(train: TrainParams, program: Sequence[str]) -> int:
    """Run `program` under torchrun as `train` says and return its exit status (the agent's: 0 once the group
    finished, non-zero when it failed more than `max_restarts` times). Ctrl-C, SIGTERM (turned into `SystemExit`
    by `run_stage`) and SIGUSR1 while the group trains stop the agent first (`stop_agent`)."""
    cmd = torchrun_command(train, program)
    log.info("elastic launch: %s", " ".join(cmd))
    on_main = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = signal.signal(signal.SIGUSR1, _ExitOnPreemptionNotice()) if on_main else None
    agent = subprocess.Popen(cmd, env=launch_env(os.environ))
    try:
        return agent.wait()
    except BaseException:  # Ctrl-C, SIGTERM or SIGUSR1 (as SystemExit) while the group trains
        stop_agent(agent)
        raise
    finally:
        if on_main:  # None: a handler not set from Python, where the default is the closest Python can put back
            signal.signal(signal.SIGUSR1, signal.SIG_DFL if previous is None else previous)


#: How long a stopped launcher waits for torchrun's agent to stop its workers before it kills the agent: the
#: workers' own time to checkpoint (`WORKER_STOP_S`, after which the agent kills them) and the agent's to exit.
STOP_GRACE_S = WORKER_STOP_S + 20.0


def stop_agent(agent: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM to torchrun's agent, which passes it on to its workers: they checkpoint and stop, and the agent exits.
    Killing the agent instead (what `subprocess.run` does on an exception) would leave its workers, which run in
    sessions of their own, training with no one to stop them. Killed only after `grace_s`; returns its status."""
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
    try:
        return agent.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("torchrun's agent did not stop within %.0f s of SIGTERM: killed", grace_s)
        agent.kill()
        return agent.wait()
