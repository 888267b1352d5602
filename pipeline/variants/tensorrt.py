"""TensorRT engines built from the ONNX variants (GPU only; `pip install .[gpu]`).

FP16 engines come from the FP32 ONNX graph; INT8 engines use explicit quantization, i.e. they are built
from the calibrated QDQ ONNX model of `int8-static` (TensorRT 10 deprecates implicit INT8 calibrators).
Without CUDA or the `tensorrt` package the builders are not called: `availability()` says why, and the
stage records the variant as skipped with that reason. Everything up to the TensorRT calls (profile
shapes, availability, the skip record) is plain Python and tested on CPU."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.params import TensorRTParams, to_dict
from pipeline.variants.record import VariantInfo, write_variant
from pipeline.variants.registry import built_by, directories

log = logging.getLogger(__name__)


INPUTS = ("input_ids", "attention_mask")


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
    """Whether engines can be built here, and if not, the reason recorded for the skipped variants."""
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
    return {"tensorrt_version": trt.__version__, "precision": precision, "profile": shapes.__dict__}


class TensorRTRunner:
    """Runs a serialised engine with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API)."""

    def __init__(self, engine_path: Path) -> None:
        import tensorrt as trt
        import torch

        self.torch = torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self.torch
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        buffers = {}
        for name, array in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).cuda()
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
            buffers[name] = t
        out = torch.empty((input_ids.shape[0], 2), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address("logits", out.data_ptr())
        self.context.execute_async_v3(self.stream.cuda_stream)
        self.stream.synchronize()
        return out.cpu().numpy()


def run_tensorrt(finetuned: Path, fp32_onnx: Path, int8_static: Path, variants_root: Path,
                 params: TensorRTParams) -> dict[str, Any]:
    """Build `tensorrt-fp16`/`tensorrt-int8` where possible; otherwise write the skip record and say why.

    The profile's longest sequence is the model's own inference length (its `pipeline.json`)."""
    from pipeline.modeling import read_model_record

    max_seq = int(read_model_record(finetuned)["preprocessing"]["max_length"])
    shapes = profile_shapes(params.min_batch, params.opt_batch, params.max_batch, params.min_seq,
                            min(params.opt_seq, max_seq), max_seq)
    ok, reason = availability()
    report: dict[str, Any] = {}
    out = directories(variants_root, built_by("tensorrt"))
    sources = {"tensorrt-fp16": (fp32_onnx, "fp16"), "tensorrt-int8": (int8_static, "int8")}
    for name, (src, precision) in sources.items():
        d = out[name]
        base = {"precision": precision, "source": src.name, "profile": shapes.__dict__, **to_dict(params)}
        if not ok:
            log.warning("%s skipped: %s", name, reason)
            write_variant(d, VariantInfo.skipped(name, reason, base), finetuned)
            report[name] = {"status": "skipped", "reason": reason}
            continue
        t0 = time.perf_counter()
        info = build_engine(src / "model.onnx", d / "model.engine", shapes, precision, params.workspace_mb)
        base.update(info, build_seconds=round(time.perf_counter() - t0, 2))
        write_variant(d, VariantInfo.built(name, base), finetuned)
        report[name] = {"status": "ok"}
    return report
