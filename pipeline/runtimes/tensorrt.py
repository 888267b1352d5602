"""The TensorRT runtime: a serialised engine run with torch CUDA tensors as I/O buffers (TensorRT 10 tensor API;
GPU only, `pip install .[gpu]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

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
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> TensorRTRunner:
        """The variant's engine file (`threads` and options do not apply to a GPU engine)."""
        if info is None:
            raise VariantError(f"{directory} has no variant record: TensorRT runs engine variants only")
        return cls(model_file(directory, info))

    def describe(self) -> dict[str, Any]:
        return {"runtime": "tensorrt", "device": "cuda"}

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
