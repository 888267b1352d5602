"""The onnxruntime runtime: ONNX variants on the CPU execution provider, with explicit graph optimisation level,
thread count and batching."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.runtimes.base import checked_options
from pipeline.runtimes.batch_invariance import BATCHING_MODES, Batching, score_batch, scores_rows_alone
from pipeline.runtimes.record import VariantError, VariantInfo, model_file

#: onnxruntime's graph optimisation levels by the names `session_options` (and option `optimization`) take.
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


def session_options(threads: int | None = None, optimization: str = "all") -> Any:
    """onnxruntime session options: the graph optimisation level by name and `threads` intra-op threads with one
    inter-op thread (None: the `OMP_NUM_THREADS` cap where set, else onnxruntime's default)."""
    import onnxruntime as ort

    from pipeline.core.machine import default_threads

    if optimization not in OPTIMIZATION_LEVELS:
        raise VariantError(f"unknown onnxruntime graph optimization {optimization!r}; "
                           f"use one of {', '.join(OPTIMIZATION_LEVELS)}")
    threads = threads or default_threads()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


def ort_session(path: Path, threads: int | None = None, optimization: str = "all") -> Any:
    """An onnxruntime CPU session with explicit graph optimisation level and thread count."""
    import onnxruntime as ort

    opts = session_options(threads, optimization)
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise VariantError(f"onnxruntime cannot load {path}: {exc}") from exc


class OrtRunner:
    """Runs an ONNX variant; feeds only the inputs the graph declares.

    A graph whose activation scales span the batch (`pipeline.runtimes.batch_invariance`) is run one review per
    call, each cut to its own attention mask, under `batching="auto"` (the default), so a review gets the same
    logits alone and in any batch; `batching="batched"` forces one call per batch (to measure what that costs)."""

    format: ClassVar[str] = "onnx"

    def __init__(self, path: Path | str, threads: int | None = None, optimization: str = "all",
                 batching: Batching = "auto") -> None:
        path = Path(path)
        self.session = ort_session(path, threads, optimization)  # first: a file it cannot load is a VariantError
        self.rows_alone = scores_rows_alone(path, batching)
        self.inputs = {i.name for i in self.session.get_inputs()}
        # what the session runs with (`session_options` applied the cap to a null setting); 0 = onnxruntime's default
        self.threads = self.session.get_session_options().intra_op_num_threads or None
        self.optimization = optimization

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> OrtRunner:
        """The variant's ONNX file; options `optimization` (`OPTIMIZATION_LEVELS`, default `all`) and `batching`
        (`BATCHING_MODES`, default `auto`); any other option is a `VariantError`."""
        options = checked_options("onnxruntime", options,
                                  {"optimization": OPTIMIZATION_LEVELS, "batching": BATCHING_MODES})
        if info is None:
            raise VariantError(f"{directory} has no variant record: onnxruntime runs ONNX variants only")
        return cls(model_file(directory, info), threads, options.get("optimization", "all"),
                   options.get("batching", "auto"))

    def describe(self) -> dict[str, Any]:
        return {"runtime": "onnxruntime", "threads": self.threads, "optimization": self.optimization,
                "batching": "rows" if self.rows_alone else "batched"}

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)}
        return self.session.run(None, {k: v for k, v in feed.items() if k in self.inputs})[0]

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return score_batch(self._run, input_ids, attention_mask, self.rows_alone)
