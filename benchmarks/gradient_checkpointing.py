"""Peak memory and step time of a training step at 512 tokens with and without gradient checkpointing
(`train.gradient_checkpointing`: each encoder layer's activations recomputed in the backward pass).

Each setting runs in a fresh process, so one's allocations cannot hide the other's peak: random weights of the
architecture (memory and time do not depend on the values), every review padded to `--seq` tokens, AdamW, `--steps`
timed steps after `--warmup`. Peak memory is `torch.cuda.max_memory_allocated` on CUDA; on a CPU it is the
process's peak resident memory (VmHWM, as the benchmark stage's memory probe reads it) above what it held once the
model and optimizer state existed, i.e. what the steps themselves added. Prints a table and writes
`benchmarks/results/gradient_checkpointing.json`.

    python -m benchmarks.gradient_checkpointing --model minilm --batch 16 --seq 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.core.io import write_json
from pipeline.evaluation.memory_probe import vm_hwm_mb

ROOT = Path(__file__).resolve().parents[1]


def measure(model_name: str, checkpointing: bool, batch: int, seq: int, steps: int, warmup: int,
            device: str) -> dict[str, Any]:
    """One setting, in this process."""
    from benchmarks.seed_recipe import build_model
    from pipeline.training.classifier import build_optimizer, enable_gradient_checkpointing

    torch.manual_seed(0)
    model = build_model(model_name, "random").to(device).train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    opt = build_optimizer(model, 5e-5, 0.01)
    ids = torch.randint(1000, 20000, (batch, seq), device=device)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (batch,), device=device)

    def step(n: int = batch, width: int = seq) -> None:
        loss = model(input_ids=ids[:n, :width], attention_mask=mask[:n, :width], labels=labels[:n]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # One step on a single 8-token review creates the optimizer's state with next to no activations: the baseline
    # (the peak RSS is a high-water mark, so a full step here would already hold the peak being measured).
    step(1, 8)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = vm_hwm_mb()
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else vm_hwm_mb()
    return {"gradient_checkpointing": checkpointing, "step_ms": round(1000 * seconds, 1),
            "peak_mb": round(peak, 1), "peak_above_model_and_optimizer_mb": round(peak - base, 1),
            "memory_measure": "cuda max_memory_allocated" if device == "cuda" else "process peak RSS (VmHWM)"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["minilm", "distilbert"], default="minilm")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process's single setting
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gradient_checkpointing.json")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.one:
        print(json.dumps(measure(args.model, args.one == "on", args.batch, args.seq, args.steps, args.warmup,
                                 device)))
        return

    from benchmarks.provenance import provenance

    rows = []
    for setting in ("off", "on"):
        cmd = [sys.executable, "-m", "benchmarks.gradient_checkpointing", "--one", setting, "--model", args.model,
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", device]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    off, on = rows
    result = {**provenance("benchmarks.gradient_checkpointing", argv, threads=torch.get_num_threads()),
              "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "model": args.model, "batch": args.batch,
              "seq": args.seq, "steps": args.steps, "rows": rows,
              "memory_saved_pct": round(100 * (1 - on["peak_above_model_and_optimizer_mb"]
                                               / max(off["peak_above_model_and_optimizer_mb"], 1e-9)), 1),
              "step_time_ratio": round(on["step_ms"] / off["step_ms"], 2)}
    write_json(args.out, result)  # written whole: an interrupted run leaves the previous file
    print(f"{args.model}, batch {args.batch} x {args.seq} tokens on {result['gpu'] or result['machine']['cpu']}")
    print(f"{'checkpointing':<15}{'step ms':>10}{'peak MB':>10}{'added by steps MB':>20}")
    for r in rows:
        print(f"{'on' if r['gradient_checkpointing'] else 'off':<15}{r['step_ms']:>10}{r['peak_mb']:>10}"
              f"{r['peak_above_model_and_optimizer_mb']:>20}")
    print(f"memory added by the steps {result['memory_saved_pct']}% lower, step time x{result['step_time_ratio']}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
