"""Speed of each INT8 weight format (`quantize.weight_format`) on this CPU, the same models, in one run.

`auto` picks the format from the CPU's flags (`pipeline.core.machine.resolve_weight_format`): signed 8-bit (`s8`)
where VNNI/AMX make it exact, unsigned 8-bit (`u8`) elsewhere, with 7-bit signed (`s7`) as the coarser setting for
AVX2-only CPUs. What each costs in time depends on which onnxruntime kernel runs it on this CPU, so the choice is
only as good as a measurement of all of them side by side. For every `--models` entry (a finetuned or distilled
HF directory) and every format this script builds the int8-dynamic recipe the pipeline uses for the teacher, the
pruned and the distilled model (`pipeline.variants.fusion.fused_dynamic_int8`: [CLS] readout as
`export.cls_readout` says, fused graph checked against the model, dynamic INT8) into `--work/<format>/<name>`,
then times FP32 eager (`--reference`), the `--fp32-rows` as the pipeline built them and every build with the
benchmark stage's alternating rounds (`pipeline.evaluation.latency.measure`). Prints a table and writes
`benchmarks/results/weight_formats.json` with the CPU's flags; accuracy is the held-out benchmark's job
(`benchmarks.heldout_accuracy --variants-dir WORK/<format>`).

Signed 8-bit on a CPU without VNNI/AMX is timed too, but its products saturate there (the output says so): it is
a speed reference, not a candidate.

    python -m benchmarks.weight_formats --models int8-dynamic=models/finetuned,int8-distilled=models/distilled
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance
from pipeline.core.io import read_json, write_json
from pipeline.core.machine import WEIGHT_FORMATS, Choice, cpu_flags, resolve_weight_format
from pipeline.core.params import Params, load_params
from pipeline.evaluation.latency import latency_inputs, measure, speedup, throughput_batches
from pipeline.runtimes.catalog import REFERENCE

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, model_dir: Path, fmt: str, work: Path, tokenized: Path, params: Params) -> Path:
    """`work/<fmt>/<name>`: the model's int8-dynamic recipe with `fmt` weights (reused when a previous run built
    it from the same model file and settings)."""
    from pipeline.modeling import load_finetuned, pad_id
    from pipeline.runtimes.record import VariantInfo, write_variant
    from pipeline.variants.export import max_length_of
    from pipeline.variants.fusion import FusionCheck, fused_dynamic_int8

    out = work / fmt / name
    stamp = work / fmt / f"{name}.built_from.json"
    source = {"model": str(model_dir.resolve()), "mtime": (model_dir / "model.safetensors").stat().st_mtime,
              "cls_readout": params.export.cls_readout, "opset": params.export.opset,
              "per_channel": params.quantize.per_channel}
    if stamp.is_file() and read_json(stamp) == source and (out / "model.onnx").is_file():
        return out
    model, tokenizer, meta = load_finetuned(model_dir)
    pad = pad_id(tokenizer)
    check = FusionCheck.of_model(model, name, tokenized=tokenized, max_length=max_length_of(meta), pad_id=pad,
                                 export=params.export)
    choice = Choice("quantize.weight_format", fmt, fmt, "set by benchmarks.weight_formats")
    with tempfile.TemporaryDirectory(prefix="weight-formats-") as tmp:
        built = fused_dynamic_int8(model, name, out, check, export=params.export,
                                   per_channel=params.quantize.per_channel, weight_format=choice, tmp=Path(tmp))
    write_variant(out, VariantInfo.built(name, {"method": "benchmarks.weight_formats", **built}), model_dir)
    write_json(stamp, source)
    return out


def parse_models(text: str) -> dict[str, Path]:
    """`name=DIR,name=DIR` -> {name: DIR}."""
    models = {}
    for item in (i for i in text.split(",") if i):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--models: {item!r} is not NAME=DIR")
        models[name] = Path(path)
    return models


def saturation_note(formats: list[str], flags: frozenset[str] | None = None) -> str:
    """What the table must say about `s8` where this CPU's kernels saturate it (no VNNI/AMX): decided from the
    CPU's own flags (`flags`: this CPU's unless given), not from flags the `auto` decisions rehearse
    (`PIPELINE_CPU_FLAGS`), since the timed kernels run on this CPU."""
    exact_s8 = resolve_weight_format("auto", cpu_flags() if flags is None else flags).value == "s8"
    if "s8" in formats and not exact_s8:
        return "s8 saturates without VNNI/AMX: timed as a speed reference only"
    return ""


def main(argv: list[str] | None = None) -> None:
    """Build each model in each format, time them alternating with FP32, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--models", default=f"int8-dynamic={ROOT / 'models/finetuned'}",
                        help="NAME=DIR,...: HF model directories (finetuned, distilled) to quantize")
    parser.add_argument("--reference", type=Path, default=ROOT / "models/finetuned",
                        help="the FP32 eager model every speed-up is against")
    parser.add_argument("--variants-root", type=Path, default=ROOT / "models/variants")
    parser.add_argument("--fp32-rows", default="fp32-onnx", help="variants under --variants-root timed as built")
    parser.add_argument("--tokenized", type=Path, default=ROOT / "data/tokenized")
    parser.add_argument("--formats", default="u8,s7,s8")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "weight_formats")
    parser.add_argument("--rounds", type=int, default=None, help="default: benchmark.rounds")
    parser.add_argument("--iterations", type=int, default=None, help="latency samples per row; default: benchmark's")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/weight_formats.json")
    args = parser.parse_args(argv)

    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(WEIGHT_FORMATS))
    if unknown or not formats:
        raise SystemExit(f"--formats: {unknown or 'none'} given; choose from {list(WEIGHT_FORMATS)}")
    models = parse_models(args.models)
    params = load_params(args.params)
    bench = dataclasses.replace(params.benchmark, rounds=args.rounds or params.benchmark.rounds,
                                iterations=args.iterations or params.benchmark.iterations)
    builds = {f"{name} {f}": build(name, d, f, args.work, args.tokenized, params)
              for name, d in models.items() for f in formats}

    import torch

    from pipeline.data.tokens import read_tokenized
    from pipeline.modeling import saved_pad_id
    from pipeline.runtimes.registry import load_runner

    torch.set_num_threads(args.threads)
    runners: dict[str, Any] = {REFERENCE: load_runner(args.reference, args.threads)}
    for name in (n for n in args.fp32_rows.split(",") if n):
        runners[name] = load_runner(args.variants_root / name, args.threads)
    runners.update({row: load_runner(d, args.threads) for row, d in builds.items()})
    seqs = read_tokenized(args.tokenized, "test")["input_ids"].tolist()
    pad = saved_pad_id(args.reference)
    timings = measure(runners, latency_inputs(seqs, bench.seq_len, bench.latency_reviews, pad),
                      throughput_batches(seqs, bench.batch_size, bench.throughput_batches, pad), bench)

    ref = timings[REFERENCE]
    rows = []
    for row, t in timings.items():
        gain = speedup(ref, t)
        rows.append({"row": row, "p50_ms_b1": t["p50_ms_b1"], "p95_ms_b1": t["p95_ms_b1"],
                     "throughput_b32": t["throughput_b32"], "speedup_p50": gain.p50,
                     "speedup_low": gain.low, "speedup_high": gain.high})
    auto = resolve_weight_format("auto")  # what the pipeline picks on this CPU (or the rehearsed flags), and why
    result = {"formats": formats, "models": {k: str(v) for k, v in models.items()}, "rows": rows,
              "auto": auto.value, "auto_choice": auto.tag(),
              "note": saturation_note(formats),
              "settings": {"seq_len": bench.seq_len, "batch_size": bench.batch_size, "rounds": bench.rounds,
                           "iterations": bench.iterations, "warmup": bench.warmup},
              **provenance("benchmarks.weight_formats", argv, threads=args.threads)}
    write_json(args.out, result)
    print(f"\nINT8 weight formats: batch-1 p50 at {bench.seq_len} tokens, reviews/s at batch {bench.batch_size}, "
          f"{args.threads} threads, {bench.rounds} alternating rounds; speed-up vs {REFERENCE}")
    print(f"{'row':<24}{'p50 ms':>9}{'p95 ms':>9}{'rev/s':>9}   speed-up (90 % interval)")
    for r in rows:
        print(f"{r['row']:<24}{r['p50_ms_b1']:>9.2f}{r['p95_ms_b1']:>9.2f}{r['throughput_b32']:>9.1f}"
              f"{r['speedup_p50']:>9.2f}x ({r['speedup_low']:.2f}-{r['speedup_high']:.2f})")
    print(f"auto here: {auto.tag()}")
    if result["note"]:
        print(result["note"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
