"""The OpenVINO runtime: OpenVINO IR variants (`model.xml` + `model.bin`) on OpenVINO's CPU plugin, with explicit
threads, the LATENCY hint and one stream (as served); the plugin's inference precision (bf16 where the CPU has
native bf16, else f32) is its own run-time choice, read back and described. An `InferRequest` serves one call at a
time, so the runner lends each call one of its own (`pipeline.runtimes.pool.Pool`): calls from many threads at once
queue on the one stream instead of failing with "Infer Request is busy". Option `streams` > 1 (the evaluate stage's
scoring of a test split by rows) splits the threads into that many streams, so that many calls run side by side."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.runtimes.base import checked_options
from pipeline.runtimes.batch_invariance import BATCHING_MODES, Batching, score_batch, scores_rows_alone
from pipeline.runtimes.pool import Pool
from pipeline.runtimes.record import VariantError, VariantInfo, model_file


def compiled_model(model: Path | Any, threads: int | None = None, streams: int = 1) -> Any:
    """`model` (an IR file, or an `openvino.Model` in memory) compiled for the CPU: `threads` inference threads
    (None: the `OMP_NUM_THREADS` cap where set, else the plugin's default), and no CPU pinning where `pins_cores`
    says so. One stream (the LATENCY hint, as every server runs it) unless `streams` > 1: then the THROUGHPUT hint
    with that many streams sharing the threads, each running its own call."""
    from pipeline.core.machine import default_threads

    streams = checked_streams(streams)
    threads = threads or default_threads()
    try:
        import openvino as ov
    except ImportError as exc:
        raise VariantError(f"{model} is an OpenVINO model and openvino is not installed: {exc}") from exc
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY" if streams == 1 else "THROUGHPUT",
                              "NUM_STREAMS": streams}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if not pins_cores(threads):
        config["ENABLE_CPU_PINNING"] = False
    try:
        return ov.Core().compile_model(str(model) if isinstance(model, Path) else model, "CPU", config)
    except Exception as exc:
        raise VariantError(f"OpenVINO cannot load {model}: {exc}") from exc


def checked_streams(streams: Any) -> int:
    """`streams` (the runner's option, `compiled_model`'s argument) if it is an integer of at least 1, else a
    `VariantError`: checked once here for both, before any file is read."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise VariantError(f"openvino option streams must be an integer of at least 1, not {streams!r}")
    return streams


#: Held while OpenVINO's Python module sets up its NumPy API (`numpy_api_ready`).
_NUMPY_API_LOCK = threading.Lock()


def numpy_api_ready() -> None:
    """Make OpenVINO's Python module set up its NumPy API now, in one thread. pybind11 does it on the module's first
    NumPy conversion, under a call-once that two threads entering together can deadlock on, the GIL held: two first
    `infer` calls at once (a server's first concurrent requests, evaluate's parallel callers) hung the whole process,
    in some fresh processes, not all (`tests/unit/runtimes/test_openvino_threads.py`). After the first, a call only
    repeats a one-element conversion."""
    import openvino as ov

    with _NUMPY_API_LOCK:  # a second thread waits here with the GIL released, not inside pybind11's call-once
        np.asarray(ov.Tensor(np.zeros(1, dtype=np.int64)).data)


def pins_cores(threads: int | None) -> bool:
    """Whether the CPU plugin may pin its inference threads to cores (its default on Linux): not when they are fewer
    than the CPUs this process may run on. The plugin pins from the first core in every process, blind to the
    others, so processes that each take part of the machine (Spark's Python workers, one per task, each capped to
    its task's cores) would all run on core 0: two Spark tasks on two cores scored at the rate of one (both
    workers' `Cpus_allowed_list` was `0`; docs/serving.md, "Scoring a file or a table"). A process that takes
    every core (the servers, the stages) keeps the plugin's pinning, as measured."""
    from pipeline.core.machine import available_cpus

    return not threads or threads >= available_cpus()


def inference_precision(compiled: Any) -> str:
    """The floating-point precision a compiled model runs its float layers in, as OpenVINO names it (`f32`, `bf16`,
    `f16`). No `INFERENCE_PRECISION_HINT` is given at compile time, so the CPU plugin picks it: `bf16` where the CPU
    has native bf16 (AMX, AVX512-BF16), `f32` elsewhere; scores and timings depend on it, so it is read back here
    and recorded with them."""
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")
    return str(precision.get_type_name()) if hasattr(precision, "get_type_name") else str(precision)


class OpenVinoRunner:
    """Runs an OpenVINO IR variant; feeds only the inputs the model declares.

    Under `batching="auto"` (the default) an INT8 IR scores one unpadded review per call: its activation scales are
    static, yet a batch's other shape picks other float kernels, whose rounding can move an activation across a
    quantization step (`pipeline.runtimes.batch_invariance.STATIC_QUANTIZE_IR_OPS`); a float IR scores a batch in
    one call. Either way a review gets the same answer alone and in any batch
    (`tests/unit/deployment/test_batch_invariance.py` checks it through the serving path)."""

    format: ClassVar[str] = "openvino"

    def __init__(self, path: Path, threads: int | None = None, batching: Batching = "auto", streams: int = 1) -> None:
        self.compiled = compiled_model(path, threads, streams)
        numpy_api_ready()  # before any call can come from two threads at once
        # one infer request per concurrent call, made on demand and reused (thread-safe: see the module doc)
        self.requests: Pool[Any] = Pool(self.compiled.create_infer_request)
        self.inputs = {p.get_any_name() for p in self.compiled.inputs}
        self.rows_alone = scores_rows_alone(Path(path), batching)
        # what the plugin runs with (`compiled_model` applied the cap to a null setting, or the plugin chose)
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> OpenVinoRunner:
        """The variant's IR file; option `batching` (`BATCHING_MODES`, default `auto`: one call per batch) and
        `streams` (an int ≥ 1, default 1: how many calls run side by side, the threads split between them); any
        other option is a `VariantError`."""
        options = checked_options("openvino", options, {"batching": BATCHING_MODES, "streams": None})
        if info is None:
            raise VariantError(f"{directory} has no variant record: OpenVINO runs OpenVINO IR variants only")
        streams = checked_streams(options.get("streams", 1))
        return cls(model_file(directory, info), threads, options.get("batching", "auto"), streams)

    def describe(self) -> dict[str, Any]:
        """The runtime and what it was compiled with: threads, batching and the float precision the CPU plugin
        chose (`inference_precision`, the function)."""
        import openvino as ov

        return {"runtime": "openvino", "version": ov.__version__, "threads": self.threads,
                "cpu_pinning": bool(self.compiled.get_property("ENABLE_CPU_PINNING")),
                "inference_precision": inference_precision(self.compiled),
                "streams": int(self.compiled.get_property("NUM_STREAMS")),
                "batching": "rows" if self.rows_alone else "batched",
                "concurrent_calls": "one infer request per call, pooled"}

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feed = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)}
        with self.requests.borrow() as request:
            result = request.infer({k: v for k, v in feed.items() if k in self.inputs})
            # copied while the request is still ours: its output tensor is reused by the next call that borrows it
            return np.array(result[self.compiled.outputs[0]], dtype=np.float32, copy=True)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return score_batch(self._run, input_ids, attention_mask, self.rows_alone)
