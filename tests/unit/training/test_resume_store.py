"""Unit: the resume decision (fingerprint, newest intact checkpoint, who may clear the store), the sampler's resume
position, the checkpoint writer's atomic rename and the torchrun command line."""

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
