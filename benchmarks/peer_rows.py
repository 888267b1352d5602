"""The rows of `benchmarks.peers`: the inputs every row shares (`read_inputs`), which rows there are (`row_specs`, the
models they need: `model_dirs`), building one (`build_row`) and its accuracy (`accuracy_of`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peer_runtimes import BuildInputs, PeerRuntime, PeerSpec, runtime_for, specs
from pipeline.core.params import Params
from pipeline.evaluation.latency import latency_inputs, throughput_batches

#: `--ort-tuning` rows: onnxruntime settings tried on the pipeline's INT8 variants (`PipelineVariant` options).
ORT_TUNING: dict[str, dict[str, Any]] = {
    "no-spin": {"allow_spinning": False},
    "parallel": {"execution_mode": "parallel", "inter_op_threads": 2},
    "batched": {"batching": "batched"},
}


@dataclasses.dataclass
class Inputs:
    """Everything built from the data once and shared by every row."""

    test_seqs: list[np.ndarray]
    labels: np.ndarray
    pad: int
    calibration: list[tuple[np.ndarray, np.ndarray]]
    lat_inputs: list[tuple[np.ndarray, ...]]
    tp_batches: list[tuple[np.ndarray, ...]]


def read_inputs(finetuned: Path, tokenized: Path, params: Params, reviews: int | None) -> Inputs:
    """Test reviews and labels, the calibration batches (the reviews int8-static calibrates on, batched as it
    does), the batch-1 latency inputs and the throughput batches, as the benchmark stage builds them."""
    from pipeline.data.tokens import read_tokenized
    from pipeline.modeling import saved_pad_id
    from pipeline.runtimes.base import pad_batch
    from pipeline.variants.calibration import calibration_reviews

    test = read_tokenized(tokenized, "test")
    if reviews:
        test = test.iloc[:reviews]
    seqs = [np.asarray(s) for s in test["input_ids"].tolist()]
    pad = saved_pad_id(finetuned)
    calib = calibration_reviews(read_tokenized(tokenized, "train"), params)
    size = params.quantize.calibration_batch_size
    batches = [pad_batch(calib[i : i + size], pad) for i in range(0, len(calib), size)]
    b = params.benchmark
    return Inputs(seqs, test["label"].to_numpy(), pad, batches,
                  latency_inputs(seqs, b.seq_len, b.latency_reviews, pad),
                  throughput_batches(seqs, b.batch_size, b.throughput_batches, pad))


def model_dirs(finetuned: Path, student: Path, wanted: list[str]) -> tuple[dict[str, Path], dict[str, str]]:
    """The HF directory of each wanted model, and the reason for each wanted model that is missing."""
    from pipeline.modeling import read_model_record

    dirs, missing = {}, {}
    for role, d in (("teacher", finetuned), ("student", student)):
        if role not in wanted:
            continue
        if not (d / "model.safetensors").is_file():
            record = read_model_record(d) if (d / "pipeline.json").is_file() else {}
            missing[role] = record.get("reason") or f"no model in {d} (the {role} was not built)"
        else:
            dirs[role] = d
    return dirs, missing


def row_specs(roles: list[str], tuning: bool) -> list[tuple[PeerSpec, dict[str, Any]]]:
    """Every row for `roles`, with the `PipelineVariant` options of the tuning rows."""
    out: list[tuple[PeerSpec, dict[str, Any]]] = [(s, {}) for s in specs(roles)]  # type: ignore[arg-type]
    if tuning:
        for s in [s for s, _ in out if s.ours and s.runtime == "onnxruntime" and s.precision.startswith("int8")]:
            for tag, options in ORT_TUNING.items():
                out.append((dataclasses.replace(s, variant=f"{s.variant}+{tag}"), options))
    return out


def build_row(spec: PeerSpec, options: dict[str, Any], model_dir: Path, variants_root: Path, threads: int,
              inputs: Inputs, compile_backend: str) -> PeerRuntime:
    """Load one row's runtime (raises `PeerUnavailable` with the reason)."""
    runtime = runtime_for(spec, **options)  # a tuning row `<variant>+<tag>` loads its base variant
    build = BuildInputs(model_dir, variants_root, threads, inputs.lat_inputs[0], inputs.calibration,  # type: ignore[arg-type]
                        compile_backend)
    return runtime.load(build)


def accuracy_of(runtime: PeerRuntime, inputs: Inputs, batch: int) -> tuple[float, np.ndarray]:
    """Test accuracy and predicted labels, the reviews batched by length as the evaluate stage does."""
    from pipeline.runtimes.base import predict_logits

    pred = predict_logits(runtime, inputs.test_seqs, batch, inputs.pad).argmax(axis=1)
    return float((pred == inputs.labels).mean()), pred
