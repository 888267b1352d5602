"""The TensorRT runtime: a serialised engine run with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API;
GPU only, `pip install .[gpu]`). An execution context holds its input shapes and tensor addresses between
`set_*` and `execute_async_v3`, so it serves one call at a time: each call borrows a context and a CUDA stream of
its own from a pool (`pipeline.runtimes.pool.Pool`); the engine is shared, as TensorRT allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.runtimes.pool import Pool
from pipeline.runtimes.record import VariantError, VariantInfo, model_file


class TensorRTRunner:
    """Runs a serialised engine with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API)."""

    format: ClassVar[str] = "tensorrt"

    def __init__(self, engine_path: Path) -> None:
        import tensorrt as trt
        import torch

        self.torch = torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        # (execution context, its stream) per concurrent call, made on demand and reused
        self.contexts: Pool[tuple[Any, Any]] = Pool(lambda: (self.engine.create_execution_context(),
                                                             torch.cuda.Stream()))

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> TensorRTRunner:
        """The variant's engine file (`threads` and options do not apply to a GPU engine)."""
        if info is None:
            raise VariantError(f"{directory} has no variant record: TensorRT runs engine variants only")
        return cls(model_file(directory, info))

    def describe(self) -> dict[str, Any]:
        return {"runtime": "tensorrt", "device": "cuda",
                "concurrent_calls": "one execution context and CUDA stream per call, pooled"}

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self.torch
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        with self.contexts.borrow() as (context, stream), torch.cuda.stream(stream):
            buffers = {}  # held until the stream is done with them
            for name, array in feeds.items():
                t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).cuda(non_blocking=True)
                context.set_input_shape(name, tuple(t.shape))
                context.set_tensor_address(name, t.data_ptr())
                buffers[name] = t
            out = torch.empty((input_ids.shape[0], 2), dtype=torch.float32, device="cuda")
            context.set_tensor_address("logits", out.data_ptr())
            context.execute_async_v3(stream.cuda_stream)
            stream.synchronize()
            return out.cpu().numpy()
