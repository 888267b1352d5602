"""Training that survives its process: the finetune stage killed (SIGKILL), stopped (SIGTERM) or re-run with other
settings, and a 2-process gloo torchrun job that loses a worker; real stage processes on the tiny BERT.

What an uninterrupted run of `TRAIN` gives is known without running one: `STEPS` optimizer steps over
`SAMPLES` reviews, one curve row and one logged loss per step (1 to `STEPS`), and a test accuracy of 1.0 on the
synthetic splits. The killed run, resumed, must give the same."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from serving.local_servers import free_port
from tests.factories import ROOT, write_tokenized

# 3 epochs of 75 batches: long enough to be interrupted between two checkpoints (every 10 steps)
TRAIN = {"epochs": 3, "batch_size": 8, "eval_batch_size": 32, "lr": 3e-3, "accelerator": "cpu", "warmup_ratio": 0.0,
         "val_checks_per_epoch": 1, "max_length": None, "checkpoint_every_n_steps": 10, "threads": 1}
STEPS = 3 * 600 // 8
SAMPLES = 3 * 600


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> Path:
    return write_tokenized(tmp_path_factory.mktemp("resume-data") / "tokenized", {"train": 600, "val": 32, "test": 64})


def _params(d: Path, **train) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"] = {"source": "tiny", "name": "tiny", "head": "cls"}
    raw["data"]["max_length"] = 64
    raw["benchmark"]["seq_len"] = 64  # the batch-1 latency length is at most data.max_length
    raw["train"].update({**TRAIN, "checkpoint_dir": str(d / "checkpoints"), **train})
    raw["mlflow"].update({"tracking_uri": f"sqlite:///{d / 'mlflow.db'}", "system_metrics": False})
    d.mkdir(parents=True, exist_ok=True)
    (d / "params.yaml").write_text(yaml.safe_dump(raw))
    return d / "params.yaml"


def _cmd(d: Path, tokenized: Path) -> list[str]:
    return [sys.executable, "-m", "stages.finetune", "--params", str(d / "params.yaml"), "--tokenized", str(tokenized),
            "--model-dir", str(d / "model"), "--metrics", str(d / "metrics.json"), "--plots", str(d / "plots"),
            "--reports", str(d / "reports")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PIPELINE_CPU_FLAGS")}
    return {**env, "PYTHONPATH": str(ROOT), "PIPELINE_RUN_ID": "resume-test", "PYTHONUNBUFFERED": "1"}


def _run(d: Path, tokenized: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(d, tokenized), cwd=d, env=_env(), capture_output=True, text=True, timeout=timeout)
    (d / "run.log").write_text(proc.stdout + proc.stderr)
    return proc


def _checkpoints(d: Path) -> list[Path]:
    return sorted((d / "checkpoints" / "finetune").rglob("*.ckpt"))


def _interrupt(d: Path, tokenized: Path, sig: int, min_step: int = 10, timeout: float = 300) -> tuple[int, str]:
    """Start the stage, wait for a periodic checkpoint at `min_step` or later, send `sig`; (exit status, log)."""
    log = (d / "interrupted.log").open("w")
    proc = subprocess.Popen(_cmd(d, tokenized), cwd=d, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [int(p.stem.split("=")[-1]) for p in _checkpoints(d) if p.parent.name == "periodic"]
            if steps and max(steps) >= min_step:
                proc.send_signal(sig)
                break
            time.sleep(0.01)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        log.close()
    return rc, (d / "interrupted.log").read_text()


def _metrics(d: Path) -> dict:
    return json.loads((d / "metrics.json").read_text())


def _curve_steps(d: Path) -> list[int]:
    return [int(r.split(",")[0]) for r in (d / "plots" / "train.csv").read_text().splitlines()[1:]]


def _mlflow_steps(d: Path, run_id: str, key: str = "train_loss") -> list[int]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{d / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _stage_runs(d: Path) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{d / 'mlflow.db'}")
    exp = client.get_experiment_by_name(yaml.safe_load((d / "params.yaml").read_text())["mlflow"]["experiment"])
    runs = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'finetune'", order_by=["start_time ASC"])
    return runs


def test_resume_after_sigkill_mid_epoch_reaches_the_same_step_count(tmp_path, tokenized, tracking_store):
    tracking_store(tmp_path / "mlflow.db")
    _params(tmp_path)
    rc, log = _interrupt(tmp_path, tokenized, signal.SIGKILL, min_step=30)
    assert rc == -signal.SIGKILL, log[-2000:]
    assert not (tmp_path / "model").exists()  # nothing half-written that a later stage would trust
    left = [p for p in _checkpoints(tmp_path) if p.parent.name == "periodic"]
    assert left  # (a `.tmp` file may be left where the kill cut a write: it is never taken for a checkpoint)
    saved_step = max(int(p.stem.split("=")[-1]) for p in left)
    assert 30 <= saved_step < STEPS  # killed mid-run (epoch 2 of 3 or earlier), not after

    proc = _run(tmp_path, tokenized)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m["resumed"] is True and m["resumed_from_step"] == saved_step, m["resume_reason"]
    assert f"resuming from step {saved_step}" in proc.stderr
    assert m["train_steps"] == STEPS
    assert m["train_samples_seen"] == SAMPLES  # every batch once: none repeated, none skipped
    assert _curve_steps(tmp_path) == list(range(1, STEPS + 1))  # the curve continues, one row per step
    assert m["test_accuracy"] >= 0.95  # learned as the uninterrupted run does (1.0)
    assert not (tmp_path / "checkpoints" / "finetune").exists()  # finished: nothing left to resume from
    # MLflow: the resumed run holds the whole curve, each logged step once, and closes the killed attempt
    killed, resumed = _stage_runs(tmp_path)
    assert resumed.data.tags["resume.continues"] == killed.info.run_id
    assert killed.info.status == "KILLED" and killed.data.tags["resume.continued_by"] == resumed.info.run_id
    assert _mlflow_steps(tmp_path, resumed.info.run_id) == list(range(1, STEPS + 1))
    assert resumed.data.metrics["resumed_from_step"] == saved_step


@pytest.mark.slow  # a real finetune process (or two) per test: `make test-all`
def test_preempt_sigterm_writes_a_checkpoint_and_exits_143(tmp_path, tokenized, tracking_store):
    tracking_store(tmp_path / "mlflow.db")
    _params(tmp_path, checkpoint_every_n_steps=5)
    rc, log = _interrupt(tmp_path, tokenized, signal.SIGTERM, min_step=5)
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    preempt = [p for p in _checkpoints(tmp_path) if p.name.startswith("preempt-")]
    assert len(preempt) == 1, log[-3000:]
    step = int(preempt[0].stem.split("=")[-1])
    assert 5 <= step < STEPS and "stopped by SIGTERM" in log and "run the stage again to resume" in log
    import torch

    state = torch.load(preempt[0], map_location="cpu", weights_only=True)  # loads without trusting pickles
    assert state["global_step"] == step and state["resume"]["batches_done"] >= 1
    assert {"optimizer_states", "lr_schedulers", "state_dict"} <= set(state)
    assert not (tmp_path / "model").exists()


@pytest.mark.slow  # a real finetune process (or two) per test: `make test-all`
def test_resume_starts_fresh_when_a_param_changed(tmp_path, tokenized, tracking_store):
    tracking_store(tmp_path / "mlflow.db")
    _params(tmp_path)
    rc, log = _interrupt(tmp_path, tokenized, signal.SIGKILL, min_step=10)
    assert rc == -signal.SIGKILL, log[-2000:]
    _params(tmp_path, lr=1e-3)  # another trajectory: the checkpoint is not this run's
    proc = _run(tmp_path, tokenized)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m["resumed"] is False and m["resumed_from_step"] == 0
    assert "train.lr 0.003 -> 0.001" in m["resume_reason"] and "fresh start" in proc.stderr
    assert m["train_steps"] == STEPS


def test_resume_neutral_settings_keep_the_checkpoint(tmp_path):
    """Where checkpoints go, how often, and the launcher do not change the trained weights: not in the fingerprint."""
    from pipeline.core.params import TrainParams, to_dict
    from pipeline.training.fingerprint import trajectory_settings

    a = trajectory_settings(to_dict(TrainParams()))
    b = trajectory_settings(to_dict(TrainParams(checkpoint_every_n_steps=7, checkpoint_dir="x", launcher="torchrun",
                                                max_restarts=9, threads=3)))
    assert a == b and "lr" in a and "checkpoint_dir" not in a


def _workers(pid: int) -> list:
    import psutil

    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "stages.finetune" in " ".join(child.cmdline()) and "LOCAL_RANK" in child.environ():
                out.append(child)
        except psutil.Error:
            continue
    return out


def test_the_torchrun_launcher_process_imports_no_training_code(tmp_path, tokenized):
    """Under `train.launcher: torchrun` the stage's own process only starts torchrun and waits for the group: it must
    not import torch or Lightning (seconds of CPU, and their memory held for the whole training)."""
    _params(tmp_path, launcher="torchrun", strategy="ddp", devices=2)
    argv = _cmd(tmp_path, tokenized)[3:]  # what follows `python -m stages.finetune`
    probe = ("import sys\n"
             "from pipeline.training import elastic\n"
             "elastic.launch = lambda train, program: print('loaded:', sorted({'torch', 'lightning', 'transformers'}"
             " & set(sys.modules)), program[:2]) or 0\n"
             "from pipeline.core.stage import stage_main\n"
             "from stages.finetune import finetune\n"
             f"stage_main('finetune', finetune, {argv!r})\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded: [] ['-m', 'stages.finetune']" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# Four training processes (two rounds of two workers), about 80 s of CPU: `make test-all`. `make test` keeps the
# torchrun command and its environment (tests/unit/training/test_resume_store.py), the launcher's imports (above) and
# the single-process SIGKILL resume.
@pytest.mark.slow
def test_elastic_torchrun_restarts_a_lost_worker_and_finishes(tmp_path, tokenized, tracking_store):
    """2 gloo workers under torchrun; one is SIGKILLed after a checkpoint: the agent restarts the group, which
    resumes from the checkpoint and ends with the same step count as one uninterrupted 2-process run."""
    tracking_store(tmp_path / "mlflow.db")
    _params(tmp_path, launcher="torchrun", strategy="ddp", devices=2, max_restarts=2,
            rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="elastic-test", epochs=2,
            eval_batch_size=16)  # 32 validation reviews: one batch for each rank
    log = (tmp_path / "elastic.log").open("w")
    proc = subprocess.Popen(_cmd(tmp_path, tokenized), cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    killed = None
    seen: dict[int, object] = {}  # every worker ever started: torchrun puts them in sessions of their own
    rc: int | None = None
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid)
            seen.update({w.pid: w for w in workers})
            if killed is None and any(p.parent.name == "periodic" for p in _checkpoints(tmp_path)):
                victims = [w for w in workers if w.environ().get("LOCAL_RANK") == "1"]
                if victims:
                    victims[0].send_signal(signal.SIGKILL)
                    killed = victims[0].pid
            time.sleep(0.05 if killed is None else 0.5)  # a light poll: the 2 workers need both cores
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for worker in seen.values():  # a failed test must not leave workers waiting on their peers
            with contextlib.suppress(Exception):
                worker.kill()
        log.close()
    out = (tmp_path / "elastic.log").read_text()
    assert killed is not None, out[-3000:]
    assert rc == 0, f"torchrun exit status {rc} (None: still running after 450 s)\n{out[-6000:]}"
    m = _metrics(tmp_path)
    # 600 reviews in batches of 8 sharded over 2 ranks: 37 optimizer steps an epoch (the odd batch dropped)
    assert m["train_steps"] == 2 * (75 // 2), out[-3000:]
    assert m["resumed"] is True and m["resumed_from_step"] >= 10, m["resume_reason"]
    assert "restart" in out.lower()  # torchelastic said it restarted the group
    # one kill, one restart: each rank of the second round resumed once, and no round died connecting to the
    # dead round's addresses (what a rendezvous store shared across rounds does, pytorch#135712)
    assert out.count("finetune: resuming from step") == 2 and "Connection refused" not in out, out[-4000:]


def test_every_training_jobs_trajectory_names_the_attention_kernel_fit_derives():
    """finetune and distill fingerprint `training_trajectory`: the kernel `fit` will train with (eager for bf16 on the
    CPU, the model's own otherwise), so a checkpoint trained with another kernel is another trajectory."""
    from pipeline.core.machine import training_attention
    from pipeline.core.params import TrainParams
    from pipeline.training.fingerprint import training_trajectory

    for precision in ("bf16-mixed", "32-true"):
        train = TrainParams(precision=precision, accelerator="cpu")
        assert training_trajectory(train)["attention"] == training_attention(precision, "cpu").value
    assert (training_trajectory(TrainParams(precision="bf16-mixed", accelerator="cpu"))["attention"]
            != training_trajectory(TrainParams(precision="32-true", accelerator="cpu"))["attention"])
