"""Choose the student's depth, width, data and epochs on held-out reviews, never on the test split.

Each `--config LABEL:key=value,key=value` is the current params file with those overrides: the distill stage
runs into `--work/LABEL` (after a prepare of its own when a `data.*` key changes, e.g. more transfer reviews),
then `benchmarks.heldout_accuracy` scores every candidate's `fp32-distilled` and `int8-distilled`, next to the
teacher's `int8-dynamic`, on the same unseen train-split reviews (none of them in any candidate's training or
transfer reviews), as paired differences to the FP32 teacher. Prints the trade-off table and writes `--out`
(the candidates' models stay in `--work`, which git ignores). Needs `models/finetuned` (the teacher) from `make run`.

The rule it applies and records (`chosen`): the smallest student (fewest encoder parameters, then the shortest
distillation) whose INT8 variant is within `targets.max_accuracy_loss_pt` of the FP32 teacher **by one standard
error** (Δ − s.e. ≥ −window). A point estimate just inside the window is a coin flip on the test split; the margin
asks for a candidate that is inside it on the evidence. Score as many unseen reviews as there are
(`--reviews 100000` takes them all): 3,000 leave a standard error of about 0.45 pt, larger than the differences
between most candidates.

    python -m benchmarks.distill_tradeoff --config d3:distill.depth=3 --config d4:distill.depth=4 \\
        --config d3-x16k:data.transfer_reviews=16500,distill.epochs=1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.core.io import write_json
from pipeline.core.params import load_params, set_value

ROOT = Path(__file__).resolve().parents[1]


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """`LABEL:key=value,key=value` -> (label, {key: value}); an empty override list is the params file as is."""
    label, _, rest = text.partition(":")
    if not label:
        raise SystemExit(f"--config {text!r}: expected LABEL:key=value,...")
    overrides = dict(item.split("=", 1) for item in rest.split(",") if item)
    return label, overrides


def run_config(label: str, overrides: dict[str, str], params_file: Path, work: Path, env: dict[str, str]) -> Path:
    """Distill one candidate into `work/label`; returns its directory (skips a candidate already built)."""
    out = work / label
    if (out / "metrics.json").is_file():
        print(f"{label}: already built in {out}")
        return out
    out.mkdir(parents=True, exist_ok=True)
    params = out / "params.yaml"
    shutil.copy2(params_file, params)
    for key, value in overrides.items():
        set_value(params, key, value)
    load_params(params)  # a bad override fails here, before any work
    tokenized = ROOT / "data" / "tokenized"
    if any(k.startswith("data.") for k in overrides):
        tokenized, prepared = out / "tokenized", out / "prepared"
        _run([sys.executable, "-m", "stages.prepare", "--params", str(params), "--prepared", str(prepared),
              "--tokenized", str(tokenized), "--metrics", str(out / "prepare.json")], env, out / "prepare.log")
    _run([sys.executable, "-m", "stages.distill", "--params", str(params), "--finetuned",
          str(ROOT / "models" / "finetuned"), "--tokenized", str(tokenized), "--student-dir", str(out / "student"),
          "--metrics", str(out / "metrics.json"), "--plots", str(out / "plots"), "--variants-dir",
          str(out / "variants")], env, out / "distill.log")
    return out


def _run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}); see {log}")


def excluded_reviews(dirs: list[Path], work: Path) -> Path:
    """A `prepared` directory whose train and transfer files hold every review any candidate learnt from, so the
    held-out sample avoids all of them."""
    import pandas as pd

    from pipeline.data.imdb import TRANSFER

    merged = work / "excluded"
    merged.mkdir(parents=True, exist_ok=True)
    sources = [ROOT / "data" / "prepared"] + [d / "prepared" for d in dirs if (d / "prepared").is_dir()]
    frames = {name: [pd.read_parquet(s / f"{name}.parquet") for s in sources if (s / f"{name}.parquet").is_file()]
              for name in ("train", TRANSFER)}
    for name, parts in frames.items():
        if parts:
            pd.concat(parts, ignore_index=True).drop_duplicates("text").to_parquet(merged / f"{name}.parquet")
    return merged


def choose(rows: dict[str, dict[str, Any]], window_pt: float) -> str | None:
    """The smallest candidate whose INT8 Δ to the FP32 teacher is above −`window_pt` by one standard error (fewest
    encoder parameters first, then the shortest distillation); None when no candidate is."""
    inside = [label for label, r in rows.items()
              if 100 * (r["int8-distilled"]["delta"] - r["int8-distilled"]["delta_std_error"]) >= -window_pt]
    if not inside:
        return None
    return min(inside, key=lambda label: (rows[label]["student_encoder_parameters"], rows[label]["wall_time_s"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="LABEL:key=value,... (repeatable)")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "results" / "distill")
    parser.add_argument("--reviews", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distill_tradeoff.json")
    args = parser.parse_args(argv)
    env = {**os.environ, "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI",
                                                               f"sqlite:///{args.work / 'mlflow.db'}")}
    args.work.mkdir(parents=True, exist_ok=True)
    configs = [parse_config(c) for c in args.config]
    dirs = {label: run_config(label, overrides, args.params, args.work, env) for label, overrides in configs}

    from benchmarks import heldout_accuracy

    variants = ["int8-dynamic"] + [f"{label}/{kind}={d / 'variants' / kind}" for label, d in dirs.items()
                                   for kind in ("fp32-distilled", "int8-distilled")]
    heldout_json = args.work / "heldout.json"
    heldout_accuracy.main(["--params", str(args.params), "--prepared", str(excluded_reviews(list(dirs.values()),
                                                                                              args.work)),
                           "--reviews", str(args.reviews), "--variants", ",".join(variants),
                           "--out", str(heldout_json)])
    heldout = json.loads(heldout_json.read_text())
    rows: dict[str, Any] = {}
    for label, overrides in configs:
        m = json.loads((dirs[label] / "metrics.json").read_text())
        rows[label] = {"overrides": overrides, "student_layers": m["student_layers"],
                       "student_encoder_parameters": m["student_encoder_parameters"],
                       "transfer_reviews": m["transfer_reviews"], "best_val_accuracy": m["best_val_accuracy"],
                       "train_seconds": m["train_seconds"], "wall_time_s": m["wall_time_s"],
                       **{kind: heldout["variants_vs_fp32"][f"{label}/{kind}"]
                          for kind in ("fp32-distilled", "int8-distilled")}}
    from benchmarks.provenance import provenance

    window = load_params(args.params).targets.max_accuracy_loss_pt
    chosen = choose(rows, window)
    # INT8 accuracy depends on the CPU's kernels: the machine is recorded with the figures
    result = {**provenance("benchmarks.distill_tradeoff", argv),
              "teacher_heldout": heldout["by_inference_length"], "reviews": heldout["reviews"],
              "teacher_int8_dynamic": heldout["variants_vs_fp32"]["int8-dynamic"], "candidates": rows,
              "rule": f"smallest student with INT8 delta - 1 s.e. >= -{window} pt", "chosen": chosen}
    write_json(args.out, result)
    print(f"\nheld-out: {heldout['reviews']} unseen train-split reviews; Δ = paired difference to the FP32 teacher\n")
    print("| candidate | overrides | layers | transfer | val acc | FP32 Δ | INT8 Δ | distill s |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        f, i = r["fp32-distilled"], r["int8-distilled"]
        print(f"| {label} | {', '.join(f'{k}={v}' for k, v in r['overrides'].items()) or '(params)'} | "
              f"{r['student_layers']} | {r['transfer_reviews']} | {100 * r['best_val_accuracy']:.1f} % | "
              f"{100 * f['delta']:+.2f} ± {100 * f['delta_std_error']:.2f} | "
              f"{100 * i['delta']:+.2f} ± {100 * i['delta_std_error']:.2f} | {r['wall_time_s']:.0f} |")
    print(f"\nchosen ({result['rule']}): {chosen or 'none: no candidate is inside the window by one s.e.'}")


if __name__ == "__main__":
    main()
