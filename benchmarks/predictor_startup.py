"""What a fresh serving process pays before its first answer: for each servable variant, a new Python process loads
`SentimentPredictor` (what the MLflow pyfunc, the TorchServe handler and Spark's executors load) and scores one
review; its wall time to that answer, its CPU time, its peak RSS and whether it imported torch or transformers.

    python -m benchmarks.predictor_startup --repeats 3
    python -m benchmarks.predictor_startup --code /path/to/other/checkout --out benchmarks/results/x.json

`--code` runs the processes on another checkout's `pipeline` package (a `git worktree` of an older commit, say)
with the same variants and the same Python, so two revisions are compared in one run on one machine. The
processes run one at a time, in alternating order across repeats; the median of the repeats is reported. Prints a
table and writes JSON with the CPU and its ISA flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core.io import write_json

ROOT = Path(__file__).resolve().parents[1]

#: Run in the fresh process: load, answer one review, report. CPU time is the process's own (user + system). It
#: reads VmHWM itself rather than through `pipeline.evaluation.memory_probe`: `--code` may name a checkout that
#: predates that module.
PROBE = """
import json, os, sys, time
t0 = time.perf_counter()
from pipeline.deployment.inference import SentimentPredictor
p = SentimentPredictor(sys.argv[1], threads=1)
label = p.predict(["A warm, funny and moving film."])[0].label
wall = time.perf_counter() - t0
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
times = os.times()
print(json.dumps({"label": label, "first_answer_s": wall, "cpu_s": times.user + times.system,
                  "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024,
                  "imports_torch": "torch" in sys.modules, "imports_transformers": "transformers" in sys.modules}))
"""


def probe(directory: Path, code: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(directory)], cwd=code, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(code),
                                            "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{directory}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from benchmarks.provenance import provenance
    from pipeline.runtimes.catalog import VARIANTS
    from pipeline.runtimes.record import VARIANT_FILE, read_variant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants-root", type=Path, default=ROOT / "models" / "variants")
    parser.add_argument("--code", type=Path, action="append",
                        help="a checkout whose `pipeline` the processes run (repeatable; default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "predictor_startup.json")
    args = parser.parse_args(argv)
    codes = [c.resolve() for c in (args.code or [ROOT])]
    args.variants_root = args.variants_root.resolve()  # the probes run in each checkout: the same variants for all
    names = [v.name for v in VARIANTS if v.servable and (args.variants_root / v.name / VARIANT_FILE).is_file()
             and read_variant(args.variants_root / v.name).status == "ok"]
    if not names:
        raise SystemExit(f"no built servable variant under {args.variants_root} (run `make run` first)")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {n: [] for n in names} for c in codes}
    started = time.time()
    for r in range(args.repeats):
        order = codes if r % 2 == 0 else codes[::-1]
        for name in names:
            for code in order:
                runs[str(code)][name].append(probe(args.variants_root / name, code))
    rows = []
    for code in codes:
        for name in names:
            samples = runs[str(code)][name]
            rows.append({"code": str(code), "variant": name, "repeats": len(samples),
                         **{k: statistics.median(s[k] for s in samples)
                            for k in ("first_answer_s", "cpu_s", "peak_rss_mb")},
                         "imports_torch": samples[0]["imports_torch"],
                         "imports_transformers": samples[0]["imports_transformers"]})
    print(f"{'code':<28} {'variant':<26} {'first answer s':>14} {'CPU s':>7} {'peak RSS MB':>11}  torch  transformers")
    for row in rows:
        print(f"{Path(row['code']).name:<28} {row['variant']:<26} {row['first_answer_s']:>14.2f} {row['cpu_s']:>7.2f} "
              f"{row['peak_rss_mb']:>11.0f}  {row['imports_torch']!s:<6} {row['imports_transformers']}")
    write_json(args.out, {**provenance("benchmarks.predictor_startup", argv, threads=1, at=started), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
