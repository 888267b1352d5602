"""Unit: Lightning finetuning on a tiny BERT, the finetune stage's error path, and 2-process DDP on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.params import DataParams, ModelParams, Params, TrainParams, resolve_auto
from pipeline.modeling import load_finetuned
from pipeline.training.finetune import FinetuneOutputs, finetune
from tests.factories import ROOT, wait_for_file

TINY_TRAIN = {"epochs": 4, "batch_size": 8, "eval_batch_size": 16, "lr": 3e-3, "accelerator": "cpu",
              "val_checks_per_epoch": 2, "warmup_ratio": 0.0,
              "max_length": None}  # train at the tokenized length (64) of the synthetic splits


def _run(tmp_path: Path, tokenized_dir: Path, **overrides):
    out = tmp_path / "out"
    params = TrainParams(**{**TINY_TRAIN, "checkpoint_dir": str(tmp_path / "ckpt"), **overrides})
    all_params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=params)
    outputs = FinetuneOutputs(out / "model", out / "metrics.json", out / "plots", out / "reports",
                              predictions_path=out / "test-logits.npz")
    result = finetune(tokenized_dir, outputs, all_params, resolve_auto(all_params).precision)
    return out, result


def test_finetune_learns_and_writes_self_describing_model(tmp_path, tokenized_dir):
    out, _result = _run(tmp_path, tokenized_dir)
    m = json.loads((out / "metrics.json").read_text())
    assert {"test_accuracy", "test_f1", "train_samples_per_s", "wall_time_s"} <= set(m)
    assert m["train_samples_seen"] == 96 * 4
    assert m["test_accuracy"] > 0.75  # sentiment words are easy to learn; chance is 0.5
    model, _tok, meta = load_finetuned(out / "model")
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert meta["preprocessing"]["max_length"] == 64
    assert meta["params"]["train"]["lr"] == TINY_TRAIN["lr"]
    # `train.precision: auto` (the default) resolved for this CPU, recorded with the model and in the metrics
    from pipeline.core.machine import cpu_flags, resolve_precision

    resolved = resolve_precision("auto", "cpu", cpu_flags(), cuda=False).value
    assert meta["choices"]["train.precision"]["asked"] == "auto"
    assert meta["choices"]["train.precision"]["value"] == resolved == m["precision"]
    assert meta["params"]["train"]["precision"] == resolved
    # the attention kernel training ran follows from it (eager for bf16 on the CPU), recorded beside it; the saved
    # model is the model as loaded, whichever kernel trained it
    from pipeline.core.machine import training_attention

    assert meta["choices"]["train.attention"]["value"] == m["train_attention"] == \
        training_attention(resolved, "cpu", cuda=False).value
    assert model.config._attn_implementation == "sdpa"
    assert set(meta["built_on"]["isa"]) >= {"avx512_bf16", "amx_bf16"}
    assert (out / "reports" / "confusion_matrix.png").stat().st_size > 1000
    train_rows = (out / "plots" / "train.csv").read_text().splitlines()
    assert train_rows[0] == "step,train_loss,lr" and len(train_rows) == 1 + 4 * 12
    val_rows = (out / "plots" / "val.csv").read_text().splitlines()
    assert len(val_rows) == 1 + 4 * 2
    # The kept test logits are the ones the score came from, tied to the tokenized test split.
    from pipeline.core.io import read_predictions
    from pipeline.data.tokens import read_tokenized

    test = read_tokenized(tokenized_dir, "test")
    logits, saved = read_predictions(out / "test-logits.npz", test["input_ids"].tolist(), test["label"].to_numpy())
    assert (logits.argmax(-1) == test["label"].to_numpy()).mean() == m["test_accuracy"]
    assert saved["batch_size"] == TINY_TRAIN["eval_batch_size"]


def test_best_checkpoint_is_restored(tmp_path, tokenized_dir, monkeypatch):
    """The saved model is the best validation's weights, not the last step's: here the weights are moved once
    training has ended (after the last checkpoint), so only loading the best one back saves them."""
    import torch

    from pipeline.training import loop

    best: dict[str, torch.Tensor] = {}

    class MovedAtTheEnd(loop.CurveRecorder):
        def on_train_end(self, trainer, pl_module) -> None:
            super().on_train_end(trainer, pl_module)
            # the best checkpoint as written (the stage removes its checkpoints once the model is saved)
            path = trainer.checkpoint_callback.best_model_path
            best.update(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(0.5)

    monkeypatch.setattr(loop, "CurveRecorder", MovedAtTheEnd)
    out, result = _run(tmp_path, tokenized_dir, epochs=2)
    assert "best-" in result.best_checkpoint
    saved = load_finetuned(out / "model")[0].state_dict()
    compared = [name for name in saved if f"model.{name}" in best]
    assert len(compared) > 10
    assert all(torch.equal(saved[name], best[f"model.{name}"].to(saved[name].dtype)) for name in compared)
    m = json.loads((out / "metrics.json").read_text())
    rows = [r.split(",") for r in (out / "plots" / "val.csv").read_text().splitlines()[1:]]  # step,epoch,acc,loss
    val = [float(r[2]) for r in rows]
    assert m["best_val_accuracy"] == pytest.approx(max(val), abs=1e-6)
    # the most accurate validation's weights, and of equally accurate ones the lower loss's (`BestByAccuracy`)
    _, step = min((float(r[3]), int(r[0])) for r in rows if float(r[2]) == max(val))
    assert Path(result.best_checkpoint).name.startswith(f"best-step={step}-"), (result.best_checkpoint, rows)


def test_finetune_trains_with_the_tokenizer_saved_beside_the_splits(tmp_path, tokenized_dir, monkeypatch):
    """The token ids and the tokenizer saved with the model are the prepare stage's pair: finetune never loads the
    tokenizer from the model's source again (which may have moved on), and splits without theirs are refused."""
    import shutil

    import pipeline.modeling

    def no_source(*_: object) -> None:
        raise AssertionError("the tokenizer was loaded from the model's source")

    monkeypatch.setattr(pipeline.modeling, "load_tokenizer", no_source)
    out, _ = _run(tmp_path, tokenized_dir, epochs=1)
    assert (out / "model" / "tokenizer_config.json").read_text() == \
        (tokenized_dir / "tokenizer" / "tokenizer_config.json").read_text()
    shutil.rmtree(tokenized_dir / "tokenizer")
    with pytest.raises(FileNotFoundError, match="dvc repro prepare"):
        _run(tmp_path / "again", tokenized_dir, epochs=1)


def test_training_window_shorter_than_inference_length(tmp_path, tokenized_dir):
    """`train.max_length` trains on 16-token windows; validation, test and the saved model keep 64 tokens."""
    out, _ = _run(tmp_path, tokenized_dir, epochs=1, max_length=16)
    m = json.loads((out / "metrics.json").read_text())
    assert m["train_tokens_per_s"] / m["train_samples_per_s"] <= 16  # mean real tokens per training review
    _model, _tok, meta = load_finetuned(out / "model")
    assert meta["preprocessing"]["max_length"] == 64 and meta["params"]["train"]["max_length"] == 16
    with pytest.raises(ValueError, match=r"exceeds data\.max_length"):
        _run(tmp_path, tokenized_dir, epochs=1, max_length=128)


def test_no_bucketing_with_grad_accum(tmp_path, tokenized_dir):
    out, _ = _run(tmp_path, tokenized_dir, epochs=1, bucketing=False, grad_accum=2)
    rows = (out / "plots" / "train.csv").read_text().splitlines()[1:]
    # 12 batches, accumulated in pairs -> 6 optimizer steps: one row each, stamped with the step it completed (none
    # for the micro-batch between two steps, which would repeat the previous step's number)
    assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3, 4, 5, 6]


def test_finetune_run_samples_the_machine_load_and_registers_nothing(tmp_path, tokenized_dir, monkeypatch,
                                                                    tracking_store):
    import mlflow

    from pipeline.core.params import MlflowParams
    from pipeline.core.parent_run import start_tracking
    from pipeline.training.finetune import FinetuneOutputs, run_finetune

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's default is 10 s
    tracking = MlflowParams(tracking_uri=tracking_store(tmp_path / "mlflow.db"), experiment="unit-finetune")
    out = tmp_path / "out"
    train = TrainParams(**{**TINY_TRAIN, "epochs": 1, "checkpoint_dir": str(tmp_path / "ckpt")})
    all_params = Params(data=DataParams(max_length=64), model=ModelParams(source="tiny"), train=train,
                        mlflow=tracking)
    outputs = FinetuneOutputs(out / "model", out / "metrics.json", out / "plots", out / "reports")
    run_finetune(tokenized_dir=tokenized_dir, outputs=outputs, all_params=all_params,
                 precision=resolve_auto(all_params).precision,
                 run_context=start_tracking(tracking, run_id="unit-finetune"))
    runs = mlflow.search_runs(experiment_names=["unit-finetune"], output_format="list",
                              filter_string="tags.`pipeline.stage` = 'finetune'")
    assert len(runs) == 1
    metrics = runs[0].data.metrics
    assert metrics["system/cpu_utilization_percentage"] >= 0 and metrics["system/system_memory_usage_megabytes"] > 0
    assert "test_accuracy" in metrics
    assert mlflow.MlflowClient().search_registered_models() == []  # the package stage registers what it serves
    assert not (out / "model" / "registered.json").exists()


def _write_params(path: Path, **train) -> None:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"] = {"source": "tiny", "name": "tiny"}
    raw["data"]["max_length"] = 64
    raw["train"]["max_length"] = None  # the default profile's 128-token window does not fit 64-token splits
    raw["benchmark"]["seq_len"] = 64  # the batch-1 latency length is at most data.max_length
    raw["train"].update({**TINY_TRAIN, "checkpoint_dir": str(path.parent / "ckpt"), **train})
    path.write_text(yaml.safe_dump(raw))


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path, tokenized_dir):
    """The finetune stage itself, launched as DDP with 2 CPU processes (Lightning re-launches rank 1)."""
    params = tmp_path / "params.yaml"
    _write_params(params, strategy="ddp", devices=2, epochs=6)
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "PYTHONPATH": str(ROOT)}
    raw = yaml.safe_load(params.read_text())
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params.write_text(yaml.safe_dump(raw))
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "stages.finetune", "--params", str(params), "--tokenized", str(tokenized_dir),
           "--model-dir", str(out / "model"), "--metrics", str(out / "m.json"), "--plots", str(out / "plots"),
           "--reports", str(out / "reports")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world_size: 2" in proc.stderr or "MEMBER: 2/2" in proc.stderr, proc.stderr[-3000:]
    m = json.loads((out / "m.json").read_text())
    # 96 reviews, batches of 8, sharded over 2 ranks: every sample still seen once per epoch
    assert m["train_samples_seen"] == 96 * 6
    assert m["test_accuracy"] > 0.6
    load_finetuned(out / "model")


def test_stage_reports_bad_params_without_traceback(tmp_path, tokenized_dir):
    params = tmp_path / "params.yaml"
    _write_params(params, precision="fp8")
    proc = subprocess.run(
        [sys.executable, "-m", "stages.finetune", "--params", str(params), "--tokenized", str(tokenized_dir),
         "--model-dir", "m", "--metrics", "m.json", "--plots", "p", "--reports", "r"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "train.precision: must be one of" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("status", "outcome"), [(0, "done"), (3, "stopped (exit 3)")])
def test_the_torchrun_launcher_stage_is_done_when_its_group_finished(tmp_path, tokenized_dir, monkeypatch, status,
                                                                      outcome):
    """Under `train.launcher: torchrun` the stage's own process waits for the group: a group that finished is a stage
    done (the run summary's "ran", not "stopped (exit 0)"); one that failed past its restarts ends the stage with its
    status."""
    from pipeline.core.stage import stage_main
    from pipeline.training import elastic
    from stages.finetune import finetune as finetune_stage

    params = tmp_path / "params.yaml"
    _write_params(params, launcher="torchrun", strategy="ddp", devices=2)
    launched: list[list[str]] = []
    monkeypatch.setattr(elastic, "launch", lambda train, program: launched.append(list(program)) or status)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = ["--params", str(params), "--tokenized", str(tokenized_dir), "--model-dir", str(tmp_path / "m"),
            "--metrics", str(tmp_path / "m.json"), "--plots", str(tmp_path / "p"), "--reports", str(tmp_path / "r")]
    if status:
        with pytest.raises(SystemExit) as stopped:
            stage_main("finetune", finetune_stage, argv)
        assert stopped.value.code == status
    else:
        stage_main("finetune", finetune_stage, argv)
    # the workers are given this stage's own command line, not the calling process's (pytest's here)
    assert launched == [["-m", "stages.finetune", *argv]]
    logged = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["outcome"]) for e in logged] == [("finetune", outcome)]


@pytest.mark.parametrize(("stop", "status"), [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_a_stopped_torchrun_launcher_passes_sigterm_to_its_agent_instead_of_killing_it(tmp_path, stop, status):
    """SIGTERM, or SIGUSR1 (a scheduler's preemption notice), to the stage process that waits for torchrun: the
    agent gets SIGTERM (it passes it on to its workers, which checkpoint and stop) and the launcher waits for it,
    then exits 128 + the signal. `subprocess.run` would SIGKILL the agent, and SIGUSR1's default action end the
    launcher alone, leaving the workers, in sessions of their own, training. A stand-in agent records the signal."""
    import signal
    import subprocess
    import sys
    import textwrap

    from tests.factories import ROOT

    started, stopped = tmp_path / "agent-started", tmp_path / "agent-stopped"
    agent = textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        def stop(signum, frame):
            time.sleep(0.5)  # the workers' checkpoint
            Path({str(stopped)!r}).write_text(signal.Signals(signum).name)
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        Path({str(started)!r}).touch()
        time.sleep(60)
    """)
    launcher = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pipeline.core.params import TrainParams
        from pipeline.core.stage import run_stage
        from pipeline.training import elastic
        elastic.torchrun_command = lambda train, program: [sys.executable, "-c", {agent!r}]
        run_stage(name="finetune", body=lambda: elastic.launch(TrainParams(), []), run_id="unit-launcher")
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=tmp_path, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PIPELINE_STAGE_LOG": str(tmp_path / "stages.jsonl")})
    try:
        assert wait_for_file(started, proc, 120)
        proc.send_signal(getattr(signal, stop))
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status
    assert stopped.read_text() == "SIGTERM"  # written before the launcher exited: it waited for the agent
