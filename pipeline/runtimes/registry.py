"""Which runtime runs which variant format, and `load_runner`: the runtime of any variant directory (or of the
finetuned HF directory, as `fp32-eager`). A new runtime is one class in one module plus one line in `RUNTIMES`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.runtimes.base import Runtime
from pipeline.runtimes.eager import TorchRunner
from pipeline.runtimes.openvino import OpenVinoRunner
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.record import VARIANT_FILE, VariantError, read_variant
from pipeline.runtimes.tensorrt import TensorRTRunner
from pipeline.runtimes.torchscript import TorchScriptRunner

#: Variant format (`pipeline.runtimes.catalog.Format`) -> the runtime class that runs it.
RUNTIMES: dict[str, type[Runtime]] = {
    "eager": TorchRunner,
    "torchscript": TorchScriptRunner,
    "onnx": OrtRunner,
    "openvino": OpenVinoRunner,
    "tensorrt": TensorRTRunner,
}


def load_runner(directory: Path, threads: int | None = None, **options: Any) -> Runtime:
    """The runtime of any variant directory (or the finetuned HF directory as `fp32-eager`), with `threads`
    intra-op threads (None: the `OMP_NUM_THREADS` cap where set, else the runtime's default) and the runtime's own
    `options` (see each runtime's `load`)."""
    directory = Path(directory)
    if not (directory / VARIANT_FILE).is_file() and (directory / "model.safetensors").is_file():
        return RUNTIMES["eager"].load(directory, None, threads, **options)
    info = read_variant(directory)
    if info.status != "ok":
        raise VariantError(f"variant {info.name} was {info.status}: {info.reason}")
    runtime = RUNTIMES.get(info.format)
    if runtime is None:
        raise VariantError(f"unknown variant format {info.format!r} in {directory}")
    return runtime.load(directory, info, threads, **options)
