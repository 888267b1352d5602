"""TensorRT engines built from the ONNX variants (GPU only; `pip install .[gpu]`).

FP16 engines come from the FP32 ONNX graph; INT8 engines use explicit quantization (TensorRT 10 deprecates
implicit INT8 calibrators), built from a QDQ model made for TensorRT (`tensorrt_qdq.quantize_qdq_for_tensorrt`:
signed symmetric int8, per-channel weights, Q/DQ only; `int8-static` itself has uint8 activations and
per-batch FFN products TensorRT cannot import). That QDQ model is built and checked where engines can be built,
or on any machine with `tensorrt.qdq_input: true`, and onnxruntime scores it on validation reviews next to
fp32-onnx, so its accuracy is known before any GPU sees it; `source_onnx` in the `tensorrt-int8` record names it
even when the engine is skipped. Without CUDA or the
`tensorrt` package the engine builders are not called: `availability()` says why, and the stage records the
engines as skipped with that reason."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.params import Params, to_dict
from pipeline.runtimes.catalog import built_by, directories
from pipeline.runtimes.record import VariantInfo, building, write_variant
from pipeline.runtimes.tensorrt import INPUTS, gpu_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileShapes:
    """One optimisation profile: (batch, sequence) at min / opt / max for every input."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]


def profile_shapes(min_batch: int, opt_batch: int, max_batch: int, min_seq: int, opt_seq: int,
                   max_seq: int) -> ProfileShapes:
    """Validated profile shapes; TensorRT rejects a profile unless min <= opt <= max on each axis."""
    if not (1 <= min_batch <= opt_batch <= max_batch):
        raise ValueError(f"need 1 <= min_batch <= opt_batch <= max_batch, got {min_batch}, {opt_batch}, {max_batch}")
    if not (1 <= min_seq <= opt_seq <= max_seq):
        raise ValueError(f"need 1 <= min_seq <= opt_seq <= max_seq, got {min_seq}, {opt_seq}, {max_seq}")
    return ProfileShapes((min_batch, min_seq), (opt_batch, opt_seq), (max_batch, max_seq))


def availability() -> tuple[bool, str]:
    """Whether engines can be built here, and if not, the reason recorded for the skipped variants. Where no
    NVIDIA driver is visible the answer needs no torch import (which costs a skipping stage seconds)."""
    from pipeline.core.machine import NVIDIA_DRIVER_PATHS, nvidia_driver_absent

    if nvidia_driver_absent():
        return False, (f"no CUDA device visible (no NVIDIA driver: none of {', '.join(NVIDIA_DRIVER_PATHS)} "
                       "exists); TensorRT needs an NVIDIA GPU")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return False, "no CUDA device visible (torch.cuda.is_available() is False); TensorRT needs an NVIDIA GPU"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False, "the `tensorrt` package is not installed (pip install '.[gpu]')"
    return True, ""


def build_engine(onnx_path: Path, engine_path: Path, shapes: ProfileShapes, precision: str,
                 workspace_mb: int = 2048) -> dict[str, Any]:
    """Parse the ONNX file and serialise an engine; `precision` is `fp16` or `int8` (explicit QDQ)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    elif precision != "fp16":
        raise ValueError(f"precision must be fp16 or int8, got {precision!r}")
    profile = builder.create_optimization_profile()
    for name in INPUTS:
        profile.set_shape(name, shapes.min, shapes.opt, shapes.max)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build a {precision} engine from {onnx_path}")
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_bytes(bytes(serialized))
    # the engine runs only on this TensorRT version and GPU model: the record says which (a refused load names them)
    return {"tensorrt_version": trt.__version__, **gpu_record(), "precision": precision, "profile": shapes.__dict__}


TENSORRT_QDQ_FILE = "model.qdq.onnx"


def tensorrt_int8_source(fp32_onnx: Path, int8_static: Path, tokenized: Path, dst: Path, params: Params,
                         pad_id: int = 0) -> dict[str, Any]:
    """Build the TensorRT INT8 input (`TENSORRT_QDQ_FILE`) from fp32-onnx, calibrated on the training reviews
    `int8-static` was calibrated on, with the method it chose (the first of `quantize.calibration_methods` where
    int8-static was not built, and the record says which); score it and fp32-onnx with onnxruntime on the whole
    validation split."""
    from pipeline.data.tokens import read_tokenized
    from pipeline.runtimes.base import predict_logits
    from pipeline.runtimes.ort import OrtRunner
    from pipeline.runtimes.record import read_variant
    from pipeline.variants.calibration import calibration_reviews
    from pipeline.variants.tensorrt_qdq import quantize_qdq_for_tensorrt

    q = params.quantize
    chosen = read_variant(int8_static).params.get("calibration")
    method = str(chosen or q.calibration_methods[0])
    method_source = "int8-static's choice" if chosen else "quantize.calibration_methods[0] (int8-static not built)"
    calibration = calibration_reviews(read_tokenized(tokenized, "train"), params)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The FFN down-projections int8-static quantizes per batch (`quantize.ffn_output_dynamic`) stay float here:
    # TensorRT has no per-batch quantization.
    ffn = int(read_variant(fp32_onnx).params["intermediate_size"]) if q.ffn_output_dynamic else None
    census = quantize_qdq_for_tensorrt(fp32_onnx / "model.onnx", dst, calibration, method, q, pad_id, ffn)
    val = read_tokenized(tokenized, "val")
    seqs, labels = val["input_ids"].tolist(), val["label"].to_numpy()
    scores = {}
    for key, path in (("fp32_onnx", fp32_onnx / "model.onnx"), ("source_onnx", dst)):
        logits = predict_logits(OrtRunner(path), seqs, q.calibration_batch_size, pad_id=pad_id)
        scores[f"{key}_val_accuracy"] = float((logits.argmax(-1) == labels).mean())
    return {"source_onnx": dst.name, "calibration_source": method_source, **census, **scores,
            "val_reviews": len(seqs),
            "source_onnx_val_loss_pt": round(100 * (scores["fp32_onnx_val_accuracy"]
                                                    - scores["source_onnx_val_accuracy"]), 3)}


def run_tensorrt(*, finetuned: Path, fp32_onnx: Path, int8_static: Path, tokenized: Path, variants_root: Path,
                 params: Params) -> dict[str, Any]:
    """Build `tensorrt-fp16`/`tensorrt-int8` where possible; otherwise write the skip record and say why.
    The INT8 engine's QDQ input (`tensorrt_int8_source`) is built where engines can be, or on any machine with
    `tensorrt.qdq_input: true`.

    Both directories are built aside (`building`) and replace the old ones, one after the other, only once
    everything is written (the INT8 engine's input, the engines, the records): a failed or killed run leaves the
    previous ones.
    The profile's longest sequence is the model's own inference length (its `pipeline.json`)."""
    from pipeline.modeling import read_model_record

    trt = params.tensorrt
    max_seq = int(read_model_record(finetuned)["preprocessing"]["max_length"])
    shapes = profile_shapes(trt.min_batch, trt.opt_batch, trt.max_batch, trt.min_seq,
                            min(trt.opt_seq, max_seq), max_seq)
    ok, reason = availability()
    report: dict[str, Any] = {}
    out = directories(variants_root, built_by("tensorrt"))
    from pipeline.modeling import saved_pad_id

    build_input = ok if trt.qdq_input == "auto" else bool(trt.qdq_input)
    with contextlib.ExitStack() as stack:
        work = {name: stack.enter_context(building(d)) for name, d in out.items()}
        if build_input:
            int8_source = tensorrt_int8_source(fp32_onnx, int8_static, tokenized,
                                               work["tensorrt-int8"] / TENSORRT_QDQ_FILE, params,
                                               saved_pad_id(finetuned))
            log.info("tensorrt-int8 input %s: %s", TENSORRT_QDQ_FILE, int8_source)
        else:  # nothing here could run the engine, and the input costs a calibration and two validation passes
            int8_source = {"source_onnx": None,
                           "source_onnx_skipped": f"tensorrt.qdq_input is {trt.qdq_input!r} and engines cannot be "
                                                  f"built here; set tensorrt.qdq_input: true to build and score it "
                                                  f"anyway"}
            log.info("tensorrt-int8 input not built: %s", int8_source["source_onnx_skipped"])
        sources = {"tensorrt-fp16": (fp32_onnx / "model.onnx", "fp16",
                                     {"source_onnx": str(fp32_onnx / "model.onnx")}),
                   "tensorrt-int8": (work["tensorrt-int8"] / TENSORRT_QDQ_FILE, "int8", int8_source)}
        for name, (src, precision, source_record) in sources.items():
            d = work[name]
            base = {"precision": precision, "profile": shapes.__dict__, **to_dict(trt), **source_record}
            measured = {k: v for k, v in source_record.items() if k != "source_onnx"}  # the input's own numbers
            if not ok:
                log.warning("%s skipped: %s", name, reason)
                write_variant(d, VariantInfo.skipped(name, reason, base), finetuned)
                report[name] = {"status": "skipped", "reason": reason, **measured}
                continue
            t0 = time.perf_counter()
            info = build_engine(src, d / "model.engine", shapes, precision, trt.workspace_mb)
            base.update(info, build_seconds=round(time.perf_counter() - t0, 2))
            write_variant(d, VariantInfo.built(name, base), finetuned)
            report[name] = {"status": "ok", **measured}
    return report
