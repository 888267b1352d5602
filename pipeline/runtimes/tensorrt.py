"""The TensorRT runtime: a serialised engine run with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API;
GPU only, `pip install .[gpu]`). An execution context holds its input shapes and tensor addresses between
`set_*` and `execute_async_v3`, so it serves one call at a time: each call borrows a context and a CUDA stream of
its own from a pool (`pipeline.runtimes.pool.Pool`); the engine is shared, as TensorRT allows.

TensorRT answers a shape outside the engine's optimisation profile, and a launch it cannot make, with False (and
a log line), not an exception; the output buffer is allocated uninitialised, so each answer is checked and a
refusal is a `VariantError` naming the shape and the profile's bounds, never logits read from unwritten memory.
An engine TensorRT cannot deserialise here (built by another TensorRT version or for another GPU) is refused the
same way at load, with what its record says it was built by and for."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.runtimes.base import checked_options
from pipeline.runtimes.pool import Pool
from pipeline.runtimes.record import VariantError, VariantInfo, model_file

#: The engine's input tensors (what `pipeline.variants.tensorrt` builds its profile for) and its output.
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "logits"


def gpu_record() -> dict[str, Any]:
    """The CUDA device engines are built for and run on here: its name and compute capability. A serialised engine
    runs only on the GPU model (compute capability) and TensorRT version it was built with, so the build record
    keeps both and a refused load names them."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}


def deserialized_engine(runtime: Any, data: bytes, path: Path, built: Mapping[str, Any],
                        here: Mapping[str, Any]) -> Any:
    """The engine `runtime` (a `tensorrt.Runtime`) reads from `data` (the file `path`); TensorRT answers an engine it
    cannot use here with None, which is a `VariantError` naming what the record says it was built with (`built`:
    `tensorrt_version`, `gpu`, `compute_capability`) against this machine's (`here`, the same keys)."""
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        keys = ("tensorrt_version", "gpu", "compute_capability")

        def said(record: Mapping[str, Any]) -> str:
            return ", ".join(f"{k} {record.get(k, 'unrecorded')}" for k in keys)

        raise VariantError(f"TensorRT cannot deserialise the engine {path}: built with {said(built)}; this machine "
                           f"has {said(here)}. An engine runs only on the TensorRT version and GPU model it was "
                           "built for: rebuild it here (dvc repro tensorrt)")
    return engine


def profile_bounds(engine: Any, profile: int = 0) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Input name -> (min, max) shape of the engine's optimisation profile `profile`, for error messages."""
    bounds = {}
    for name in INPUTS:
        low, _, high = engine.get_tensor_profile_shape(name, profile)
        bounds[name] = (tuple(int(d) for d in low), tuple(int(d) for d in high))
    return bounds


def launch(context: Any, engine: Any, *, stream_handle: int, inputs: Mapping[str, tuple[tuple[int, ...], int]],
           output_address: int, batch: int) -> None:
    """Bind `inputs` (name -> (shape, device address)) and the (`batch`, 2) float output buffer at `output_address`
    to an execution `context` of `engine`, and launch it on the CUDA stream `stream_handle`.

    Every TensorRT answer is checked, since each failure is a False and the output buffer holds no logits until the
    launch writes them: a shape outside the profile (`set_input_shape`), an output shape other than the buffer's,
    and a launch TensorRT refuses (`execute_async_v3`) are each a `VariantError`."""
    for name, (shape, address) in inputs.items():
        if not context.set_input_shape(name, shape):
            low, high = profile_bounds(engine)[name]
            raise VariantError(f"TensorRT engine refused {name} of shape {tuple(shape)} (batch, sequence): its "
                               f"optimisation profile takes {low} to {high}; score batches within those bounds "
                               "(`tensorrt.max_batch`, `tensorrt.min_seq` and the model's max_length set them)")
        context.set_tensor_address(name, address)
    produced = tuple(int(d) for d in context.get_tensor_shape(OUTPUT))
    if produced != (batch, 2):
        raise VariantError(f"TensorRT engine's {OUTPUT} for inputs {_shapes(inputs)} has shape {produced}, not "
                           f"({batch}, 2): not a two-class classifier engine")
    context.set_tensor_address(OUTPUT, output_address)
    if not context.execute_async_v3(stream_handle):
        raise VariantError(f"TensorRT could not launch the engine on inputs {_shapes(inputs)} (profile bounds "
                           f"{profile_bounds(engine)}); TensorRT's log above says why")


def _shapes(inputs: Mapping[str, tuple[tuple[int, ...], int]]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, (shape, _) in inputs.items()}


class TensorRTRunner:
    """Runs a serialised engine with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API)."""

    format: ClassVar[str] = "tensorrt"

    def __init__(self, engine_path: Path, built: Mapping[str, Any] | None = None) -> None:
        """A runner of the engine serialised in `engine_path`; `built` is its build record (what a refused load
        names, `deserialized_engine`)."""
        import tensorrt as trt
        import torch

        self.torch = torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        here = {"tensorrt_version": trt.__version__, **gpu_record()}
        self.engine = deserialized_engine(runtime, Path(engine_path).read_bytes(), Path(engine_path), built or {},
                                          here)
        # (execution context, its stream) per concurrent call, made on demand and reused
        self.contexts: Pool[tuple[Any, Any]] = Pool(lambda: (self.engine.create_execution_context(),
                                                             torch.cuda.Stream()))

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> TensorRTRunner:
        """The variant's engine file (`threads` does not apply to a GPU engine; it takes no options, and any option
        is a `VariantError`)."""
        checked_options("tensorrt", options, {})
        if info is None:
            raise VariantError(f"{directory} has no variant record: TensorRT runs engine variants only")
        return cls(model_file(directory, info), info.params)

    def describe(self) -> dict[str, Any]:
        return {"runtime": "tensorrt", "device": "cuda",
                "concurrent_calls": "one execution context and CUDA stream per call, pooled"}

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self.torch
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        with self.contexts.borrow() as (context, stream), torch.cuda.stream(stream):
            buffers = {  # held until the stream is done with them
                name: torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).cuda(non_blocking=True)
                for name, array in feeds.items()}
            out = torch.empty((input_ids.shape[0], 2), dtype=torch.float32, device="cuda")
            try:
                launch(context, self.engine, stream_handle=stream.cuda_stream,
                       inputs={name: (tuple(t.shape), t.data_ptr()) for name, t in buffers.items()},
                       output_address=out.data_ptr(), batch=input_ids.shape[0])
            finally:
                stream.synchronize()  # also after a refusal: the input copies are done before their buffers go
            return out.cpu().numpy()
