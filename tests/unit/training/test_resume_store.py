"""Unit: the resume decision (fingerprint, newest intact checkpoint, who may clear the store), the sampler's resume
position, the checkpoint writer's atomic rename, the torchrun command line, and each attempt's MLflow run (the previous
attempt's closed, a preempted one ended KILLED)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.core.params import TrainParams
from pipeline.data.batching import LengthBucketBatchSampler, LoaderPosition
from pipeline.training.checkpoints import AtomicCheckpointIO, CheckpointStore
from pipeline.training.fingerprint import Fingerprint, fingerprint


def _ckpt(path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    return path


def _inputs(tmp_path: Path, content: bytes = b"reviews") -> Path:
    d = tmp_path / "tokenized"
    d.mkdir(exist_ok=True)
    (d / "train.parquet").write_bytes(content)
    return d


def test_resume_picks_the_newest_intact_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    fp = fingerprint({"train": {"lr": 1e-4}}, [_inputs(tmp_path)])
    store.plan(fp)  # writes the fingerprint
    _ckpt(store.dir / "periodic" / "step=20.ckpt", 20)
    _ckpt(store.dir / "preempt-step=25.ckpt", 25)
    cut = store.dir / "periodic" / "step=30.ckpt"  # a write the kill cut short: not a zip any more
    cut.write_bytes(_ckpt(tmp_path / "whole.ckpt", 30).read_bytes()[:100])
    assert not zipfile.is_zipfile(cut)
    plan = store.plan(fp)
    assert plan.resumed and plan.step == 25 and plan.checkpoint.name == "preempt-step=25.ckpt"
    assert plan.record() == {"resumed": True, "resumed_from_step": 25, "resume_reason": plan.reason}


def test_resume_refused_when_fingerprint_differs_names_what_changed(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    inputs = _inputs(tmp_path)
    store.plan(fingerprint({"train": {"lr": 1e-4, "epochs": 1}}, [inputs]))
    _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    _inputs(tmp_path, b"other reviews")
    plan = store.plan(fingerprint({"train": {"lr": 2e-4, "epochs": 1}}, [inputs]))
    assert not plan.resumed and plan.step == 0
    assert "train.lr 0.0001 -> 0.0002" in plan.reason and "input data changed" in plan.reason
    assert "epochs" not in plan.reason
    assert not list(store.dir.rglob("*.ckpt"))  # cleared: a later run cannot pick the other trajectory up


def test_resume_false_and_code_change_start_fresh(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "distill", writer=True)
    fp = fingerprint({"a": 1}, [_inputs(tmp_path)])
    store.plan(fp)
    _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    assert store.plan(fp, resume=False).reason == "fresh start: train.resume is false"
    _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    other_code = Fingerprint(fp.settings, fp.data, "0" * 64)
    assert "training code changed" in store.plan(other_code).reason


def test_other_ranks_read_the_decision_but_never_clear(tmp_path):
    writer = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    reader = CheckpointStore(tmp_path / "ck", "finetune", writer=False)
    fp = fingerprint({"a": 1}, [_inputs(tmp_path)])
    writer.plan(fp)
    ckpt = _ckpt(writer.dir / "periodic" / "step=10.ckpt", 10)
    assert reader.plan(fp).checkpoint == ckpt
    assert not reader.plan(fingerprint({"a": 2}, [_inputs(tmp_path)])).resumed
    assert ckpt.exists()  # only rank 0 changes the store
    reader.clear()
    assert ckpt.exists()


def test_sampler_resumes_inside_the_epoch_once(tmp_path):
    lengths = list(range(5, 105))
    position = LoaderPosition()
    sampler = LengthBucketBatchSampler(lengths, 8, pool_batches=2, seed=3, position=position)
    sampler.set_epoch(1)
    whole = list(sampler)
    position.resume_at(epoch=1, batches_done=5)
    assert len(sampler) == len(whole)  # Lightning's epoch length stays the whole epoch's
    assert list(sampler) == whole[5:]  # the same order, the trained batches skipped
    assert list(sampler) == whole  # once: the next pass over the epoch is whole again
    position.resume_at(epoch=0, batches_done=5)
    assert list(sampler) == whole  # a position in another epoch does not apply


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "c" / "step=3.ckpt"
    io.save_checkpoint({"global_step": 3}, target)
    assert torch.load(target, weights_only=True)["global_step"] == 3
    assert not list(tmp_path.rglob("*.tmp"))

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    def cut_short(self, checkpoint, path, storage_options=None):  # the process dies in the middle of the write
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", cut_short)
    with pytest.raises(OSError):
        io.save_checkpoint({"global_step": 4}, tmp_path / "c" / "step=4.ckpt")
    assert not (tmp_path / "c" / "step=4.ckpt").exists()  # never a half-written file under the real name


def test_torchrun_command_states_the_elastic_group():
    from pipeline.training.elastic import torchrun_command

    cmd = torchrun_command(TrainParams(launcher="torchrun", devices=4, num_nodes=2, min_nodes=1, max_restarts=5,
                                       rdzv_endpoint="node-a:29400", rdzv_id="job7"), ["-m", "stages.finetune"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=1:2", "--nproc-per-node=4", "--max-restarts=5", "--rdzv-backend=c10d",
            "--rdzv-endpoint=node-a:29400", "--rdzv-id=job7"} <= set(cmd)
    assert cmd[-2:] == ["-m", "stages.finetune"]
    # the pinned torchrun reads the stop settings: SIGUSR1 passed on to the workers, their time to checkpoint
    from torch.distributed.run import get_args_parser

    from pipeline.training.elastic import WORKER_STOP_S

    args = get_args_parser().parse_args(cmd[3:])
    assert "SIGUSR1" in args.signals_to_handle.split(",") and args.shutdown_timeout == WORKER_STOP_S
    fixed = torchrun_command(TrainParams(devices=2), ["x"])
    assert "--nnodes=1" in fixed
    with pytest.raises(Exception, match="min_nodes"):
        TrainParams(num_nodes=2, min_nodes=3)


def test_torchrun_rounds_do_not_share_the_rendezvous_store():
    """Each restarted round gets its own store, so no worker reads the dead round's addresses (pytorch#135712)."""
    from pipeline.training.elastic import launch_env

    env = launch_env({"PATH": "/bin"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["PATH"] == "/bin"
    assert launch_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def _tracking(tmp_path: Path, tracking_store):
    from pipeline.core.params import MlflowParams
    from pipeline.core.parent_run import start_tracking

    params = MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-attempts",
                          system_metrics=False)
    return start_tracking(params, run_id="unit-attempts")


@pytest.mark.parametrize("why", ["no checkpoint", "other settings", "resume false"])
def test_a_fresh_start_closes_the_run_a_hard_kill_left_running(tmp_path, tracking_store, why):
    """A killed process never ends its MLflow run: the next attempt that starts fresh (nothing to resume, other
    settings, `train.resume: false`) marks it KILLED and names itself in it, as a resumed one does."""
    from pipeline.core.tracking import stage_run
    from pipeline.training.checkpoints import start_attempt

    context = _tracking(tmp_path, tracking_store)
    client = context.client()
    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    fp = fingerprint({"train": {"lr": 1e-4}}, [_inputs(tmp_path)])
    store.plan(fp)
    killed = client.create_run(context.experiment_id).info.run_id  # RUNNING, as the killed process left it
    store.remember_run(killed)
    if why != "no checkpoint":
        _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    current = fingerprint({"train": {"lr": 2e-4}}, [_inputs(tmp_path)]) if why == "other settings" else fp
    plan = store.plan(current, resume=why != "resume false")
    assert not plan.resumed and plan.previous_run_id == killed
    with stage_run(context, "finetune") as run:
        start_attempt(run, plan, store)
    previous = client.get_run(killed)
    assert previous.info.status == "KILLED" and previous.data.tags["resume.replaced_by"] == run.run_id
    assert "resume.continues" not in client.get_run(run.run_id).data.tags  # replaced, not continued
    assert store.plan(current).previous_run_id == run.run_id  # the run a later attempt would close or continue


def test_a_fresh_start_leaves_an_ended_run_as_it_ended(tmp_path, tracking_store, caplog):
    from pipeline.core.tracking import stage_run
    from pipeline.training.checkpoints import start_attempt

    context = _tracking(tmp_path, tracking_store)
    client = context.client()
    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    fp = fingerprint({"a": 1}, [_inputs(tmp_path)])
    store.plan(fp)
    failed = client.create_run(context.experiment_id).info.run_id
    client.set_terminated(failed, "FAILED")
    store.remember_run(failed)
    with stage_run(context, "finetune") as run:
        start_attempt(run, store.plan(fp), store)
    assert client.get_run(failed).info.status == "FAILED"
    store.remember_run("0" * 32)  # a run the store no longer holds: nothing to close, no failure
    with stage_run(context, "finetune") as run, caplog.at_level("INFO", logger="pipeline.core.tracking"):
        start_attempt(run, store.plan(fp), store)
    assert "is not in the store: nothing to close" in caplog.text  # told apart from a store that failed


def test_a_preempted_training_run_ends_killed_and_a_failed_one_failed(tmp_path, tracking_store):
    """Stopped by a signal after its checkpoint (to be resumed), the attempt's run ends KILLED, not FAILED as
    MLflow's run context ends a run left by any exception; a real failure, or an exit with an error's status,
    stays FAILED."""
    import signal

    from pipeline.core.tracking import stage_run
    from pipeline.training.resume import Preempted

    context = _tracking(tmp_path, tracking_store)
    ids: list[str] = []
    with pytest.raises(Preempted), stage_run(context, "finetune") as run:
        ids.append(run.run_id)
        raise Preempted(signal.SIGTERM, 5, tmp_path / "preempt-step=5.ckpt")
    with pytest.raises(RuntimeError), stage_run(context, "finetune") as run:
        ids.append(run.run_id)
        raise RuntimeError("a bug")
    with pytest.raises(SystemExit), stage_run(context, "finetune") as run:
        ids.append(run.run_id)
        raise SystemExit(2)
    with pytest.raises(KeyboardInterrupt), stage_run(context, "finetune") as run:
        ids.append(run.run_id)
        raise KeyboardInterrupt
    with stage_run(context, "finetune") as run:
        ids.append(run.run_id)
    statuses = [context.client().get_run(i).info.status for i in ids]
    assert statuses == ["KILLED", "FAILED", "FAILED", "KILLED", "FINISHED"]


def test_a_checkpoint_removed_while_another_rank_scans_is_no_resume_point(tmp_path, monkeypatch):
    """Rank 0's fresh start clears the store while another rank lists it: a file gone between its check and its
    timestamp is skipped instead of failing that rank (a restart used up)."""
    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    gone = _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    kept = _ckpt(store.dir / "preempt-step=5.ckpt", 5)
    real = zipfile.is_zipfile

    def removed_meanwhile(path):
        answer = real(path)
        if Path(path) == gone:
            gone.unlink()
        return answer

    monkeypatch.setattr(zipfile, "is_zipfile", removed_meanwhile)
    assert store.checkpoints() == [(5, kept)]


def test_a_checkpoint_that_survives_clearing_is_an_error_not_vouched_for(tmp_path, monkeypatch):
    """`clear` before a fresh start: were a checkpoint left (a removal that failed silently), the new fingerprint
    written next would make a later run resume the other trajectory's checkpoint."""
    import shutil

    from pipeline.training.checkpoints import CheckpointStoreError

    store = CheckpointStore(tmp_path / "ck", "finetune", writer=True)
    _ckpt(store.dir / "periodic" / "step=10.ckpt", 10)
    monkeypatch.setattr(shutil, "rmtree", lambda path, ignore_errors=False: None)
    with pytest.raises(CheckpointStoreError, match="could not remove"):
        store.clear()
    monkeypatch.undo()
    store.clear()
    assert not store.dir.exists()
