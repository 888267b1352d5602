"""The OpenVINO runtime: OpenVINO IR variants (`model.xml` + `model.bin`) on OpenVINO's CPU plugin, with explicit
threads, the LATENCY hint and one stream; the plugin's inference precision (bf16 where the CPU has native bf16,
else f32) is its own run-time choice, read back and described. An `InferRequest` serves one call at a time, so
the runner lends each call one of its own (`pipeline.runtimes.pool.Pool`): calls from many threads at once queue
on the one stream instead of failing with "Infer Request is busy"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.runtimes.base import checked_options
from pipeline.runtimes.batch_invariance import BATCHING_MODES, Batching, score_batch, scores_rows_alone
from pipeline.runtimes.pool import Pool
from pipeline.runtimes.record import VariantError, VariantInfo, model_file


def compiled_model(model: Path | Any, threads: int | None = None) -> Any:
    """`model` (an IR file, or an `openvino.Model` in memory) compiled for the CPU: `threads` inference threads
    (None: the `OMP_NUM_THREADS` cap where set, else the plugin's default), LATENCY hint, one stream, and no CPU
    pinning where `pins_cores` says so."""
    from pipeline.core.machine import default_threads

    threads = threads or default_threads()
    try:
        import openvino as ov
    except ImportError as exc:
        raise VariantError(f"{model} is an OpenVINO model and openvino is not installed: {exc}") from exc
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if not pins_cores(threads):
        config["ENABLE_CPU_PINNING"] = False
    try:
        return ov.Core().compile_model(str(model) if isinstance(model, Path) else model, "CPU", config)
    except Exception as exc:
        raise VariantError(f"OpenVINO cannot load {model}: {exc}") from exc


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

    def __init__(self, path: Path, threads: int | None = None, batching: Batching = "auto") -> None:
        self.compiled = compiled_model(path, threads)
        # one infer request per concurrent call, made on demand and reused (thread-safe: see the module doc)
        self.requests: Pool[Any] = Pool(self.compiled.create_infer_request)
        self.inputs = {p.get_any_name() for p in self.compiled.inputs}
        self.rows_alone = scores_rows_alone(Path(path), batching)
        # what the plugin runs with (`compiled_model` applied the cap to a null setting, or the plugin chose)
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> OpenVinoRunner:
        """The variant's IR file; option `batching` (`BATCHING_MODES`, default `auto`: one call per batch); any
        other option is a `VariantError`."""
        options = checked_options("openvino", options, {"batching": BATCHING_MODES})
        if info is None:
            raise VariantError(f"{directory} has no variant record: OpenVINO runs OpenVINO IR variants only")
        return cls(model_file(directory, info), threads, options.get("batching", "auto"))

    def describe(self) -> dict[str, Any]:
        """The runtime and what it was compiled with: threads, batching and the float precision the CPU plugin
        chose (`inference_precision`, the function)."""
        import openvino as ov

        return {"runtime": "openvino", "version": ov.__version__, "threads": self.threads,
                "cpu_pinning": bool(self.compiled.get_property("ENABLE_CPU_PINNING")),
                "inference_precision": inference_precision(self.compiled),
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
