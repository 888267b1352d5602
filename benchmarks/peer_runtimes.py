"""The runtimes a user would serve this model with instead of the pipeline's variants, behind one interface.

Each runtime is built from a finetuned Hugging Face directory (the teacher's `models/finetuned` or the student's
`models/distilled`), or, for the pipeline's own rows, from a built variant directory, and answers
`predict_logits(input_ids, attention_mask)` on padded int64 batches (it is also callable that way, so it is a
`pipeline.runtimes.base.Runner` and the benchmark stage's `measure` and `predict_logits` take it as it is).

- `pytorch-eager` FP32: the reference, exactly the benchmark stage's `fp32-eager` row.
- `torch.compile` FP32 (inductor's CPU backend), and under bf16 autocast only where the CPU has native bf16
  (AVX512-BF16 or AMX): elsewhere bf16 is emulated, and the row is skipped with that reason.
- `torchao` INT8 dynamic (`Int8DynamicActivationInt8WeightConfig`: per-token activation scales, per-channel int8
  weights), compiled with `torch.compile` as torchao documents.
- `openvino` FP32 (`openvino.convert_model` of the `torch.export`ed PyTorch model) and INT8 (`nncf.quantize`
  post-training quantization of that OpenVINO model, calibrated on the same training reviews the pipeline's
  int8-static calibrates on).
- `onnxruntime`: the pipeline's variants through `pipeline.runtimes.registry.load_runner`, as the benchmark
  stage and the servers run them (row-by-row scoring included where a graph's activation scale spans the batch).

Peers whose package is missing, or that the CPU cannot run natively, raise `PeerUnavailable` with the reason.
Nothing is imported or built at import time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

ModelRole = Literal["teacher", "student"]


class PeerUnavailable(RuntimeError):
    """A runtime that cannot be built here (package missing, or no native support on this CPU), with the reason."""


@dataclass(frozen=True)
class PeerSpec:
    """One row of the comparison: which runtime runs which model in which precision."""

    runtime: str  # e.g. "torch.compile", "openvino", "onnxruntime"
    precision: str  # "fp32", "bf16-autocast", "int8-dynamic", "int8-static", ...
    model: ModelRole
    ours: bool = False  # one of the pipeline's own variants
    variant: str | None = None  # the pipeline variant it runs (ours only)

    @property
    def name(self) -> str:
        """The row's unique name, e.g. `teacher/openvino/int8-nncf` or `teacher/onnxruntime/int8-dynamic`."""
        return f"{self.model}/{self.runtime}/{self.variant or self.precision}"


#: The peers, in table order; the first is the reference every other row is compared with.
PEERS: tuple[tuple[str, str], ...] = (
    ("pytorch-eager", "fp32"),
    ("torch.compile", "fp32"),
    ("torch.compile", "bf16-autocast"),
    ("torchao+compile", "int8-dynamic"),
    ("openvino", "fp32"),
    ("openvino", "int8-nncf"),
)
#: The pipeline's own variants per model (`pipeline.runtimes.catalog` names): (variant, precision, runtime), each
#: run as the pipeline runs it (`load_runner`).
OURS: dict[ModelRole, tuple[tuple[str, str, str], ...]] = {
    "teacher": (("fp32-onnx", "fp32", "onnxruntime"), ("int8-dynamic", "int8-dynamic", "onnxruntime"),
                ("int8-static", "int8-static", "onnxruntime"), ("int8-openvino", "int8-nncf", "openvino")),
    "student": (("fp32-distilled", "fp32", "onnxruntime"), ("int8-distilled", "int8-dynamic", "onnxruntime"),
                ("int8-distilled-openvino", "int8-nncf", "openvino")),
}


def specs(models: Sequence[ModelRole]) -> list[PeerSpec]:
    """Every row for the given models: the peers, then the pipeline's own variants."""
    out = []
    for role in models:
        out += [PeerSpec(runtime, precision, role) for runtime, precision in PEERS]
        out += [PeerSpec(runtime, precision, role, True, variant) for variant, precision, runtime in OURS[role]]
    return out


@dataclass
class BuildInputs:
    """What building a runtime needs: the HF model directory, the variants' root, threads, a sample batch to trace
    or convert with, and the calibration batches for the static INT8 peers."""

    model_dir: Path
    variants_root: Path
    threads: int
    example: tuple[np.ndarray, np.ndarray]
    calibration: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    compile_backend: str = "inductor"  # `torch.compile`'s backend; the tests take `aot_eager` (no C++ build)


class PeerRuntime:
    """Load, `predict_logits`, `describe`: the interface every runtime of the comparison has."""

    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        self.build_s: float | None = None
        self.details: dict[str, Any] = {}

    def load(self, inputs: BuildInputs) -> PeerRuntime:
        """Build the runtime and answer one batch (compilers compile lazily: the first answer is part of the build);
        `build_s` is the wall time of both."""
        t0 = time.perf_counter()
        self._load(inputs)
        self.predict_logits(*inputs.example)
        self.build_s = time.perf_counter() - t0
        return self

    def _load(self, inputs: BuildInputs) -> None:
        raise NotImplementedError

    def predict_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.predict_logits(input_ids, attention_mask)

    def describe(self) -> dict[str, Any]:
        """The row's identity and how it was built (library versions, settings), for the JSON."""
        return {"runtime": self.spec.runtime, "model": self.spec.model, "precision": self.spec.precision,
                "ours": self.spec.ours, "variant": self.spec.variant, "build_s": self.build_s, **self.details}


def package_version(module: str) -> str:
    """A package's version, or "absent"."""
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return "absent"


class TorchPeer(PeerRuntime):
    """PyTorch eager, `torch.compile`, and torchao INT8 dynamic + `torch.compile`, through the benchmark stage's
    `TorchRunner` (inference mode, optional autocast)."""

    def _load(self, inputs: BuildInputs) -> None:
        import torch

        from pipeline.core.machine import BF16_FLAGS, decision_flags
        from pipeline.modeling import load_finetuned
        from pipeline.runtimes.eager import TorchRunner, logits_module

        autocast = None
        if self.spec.precision == "bf16-autocast":
            flags, note = decision_flags()
            if not any(f in flags for f in BF16_FLAGS):
                raise PeerUnavailable("CPU has no native bf16 (no AVX512-BF16/AMX): bf16 autocast would be "
                                      f"emulated, far slower than fp32, so the row would only show emulation{note}")
            autocast = "bf16"
        torch.set_num_threads(inputs.threads)
        model, _, _ = load_finetuned(inputs.model_dir)
        self.details["versions"] = {"torch": torch.__version__}
        if self.spec.runtime == "torchao+compile":
            try:
                from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
            except ImportError as exc:
                raise PeerUnavailable(f"torchao is not installed: {exc}") from exc
            quantize_(model, Int8DynamicActivationInt8WeightConfig())
            self.details["versions"]["torchao"] = package_version("torchao")
            self.details["recipe"] = "torchao.quantization.quantize_(Int8DynamicActivationInt8WeightConfig())"
        module: Any = logits_module(model)
        if self.spec.runtime in ("torch.compile", "torchao+compile"):
            compiled = torch.compile(model, backend=inputs.compile_backend)
            self.details["compile"] = f"torch.compile(model, backend={inputs.compile_backend!r}), default mode"
            module = logits_module(compiled)
        # the reference row is the benchmark stage's fp32-eager, FP32 kernel choice included; compiled and torchao
        # rows keep the module they were given
        eager_fp32 = self.spec.runtime == "pytorch-eager" and autocast is None
        self.runner = TorchRunner(module, autocast=autocast, fp32_linear="auto" if eager_fp32 else None)

    def predict_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.runner(input_ids, attention_mask)


class OpenVinoPeer(PeerRuntime):
    """OpenVINO FP32 from `openvino.convert_model` of the PyTorch model, and INT8 from NNCF post-training
    quantization of that OpenVINO model (`nncf.quantize`, transformer preset) on the calibration batches.
    The PyTorch model reaches OpenVINO through `torch.export` with dynamic batch and length."""

    def _load(self, inputs: BuildInputs) -> None:
        try:
            import openvino as ov
        except ImportError as exc:
            raise PeerUnavailable(f"openvino is not installed: {exc}") from exc
        from pipeline.modeling import load_finetuned
        from pipeline.variants.openvino_int8 import openvino_model

        model, _, _ = load_finetuned(inputs.model_dir)
        # torch.export of the whole model (int8-openvino's route, without its [CLS] readout), not openvino's
        # TorchScript tracing of the module (torch.jit.trace is deprecated)
        ov_model = openvino_model(model, inputs.example)
        self.details["versions"] = {"openvino": ov.__version__}
        if self.spec.precision == "int8-nncf":
            try:
                import nncf
            except ImportError as exc:
                raise PeerUnavailable(f"nncf is not installed: {exc}") from exc
            if not inputs.calibration:
                raise PeerUnavailable("no calibration batches given for NNCF post-training quantization")
            data = nncf.Dataset(inputs.calibration, lambda b: {"input_ids": b[0], "attention_mask": b[1]})
            ov_model = nncf.quantize(ov_model, data, model_type=nncf.ModelType.TRANSFORMER,
                                     subset_size=len(inputs.calibration))
            self.details["versions"]["nncf"] = nncf.__version__
            self.details["recipe"] = (f"nncf.quantize(model_type=TRANSFORMER) on {len(inputs.calibration)} batches "
                                      "of the pipeline's calibration reviews")
        from pipeline.runtimes.openvino import compiled_model

        compiled = compiled_model(ov_model, inputs.threads)  # the settings int8-openvino is served with
        self.details["openvino_config"] = {k: str(compiled.get_property(k)) for k in
                                           ("INFERENCE_NUM_THREADS", "PERFORMANCE_HINT", "NUM_STREAMS",
                                            "INFERENCE_PRECISION_HINT")}
        self.request = compiled.create_infer_request()
        self.names = [p.get_any_name() for p in compiled.inputs]

    def predict_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feed = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)}
        self.request.infer({k: v for k, v in feed.items() if k in self.names})
        return np.array(self.request.get_output_tensor(0).data, dtype=np.float32)


#: `PipelineVariant` options that change the onnxruntime session beyond what `load_runner` sets.
SESSION_OPTIONS = ("allow_spinning", "execution_mode", "inter_op_threads")


class PipelineVariant(PeerRuntime):
    """One of the pipeline's own variants (onnxruntime or OpenVINO), run as the benchmark stage runs it
    (`load_runner`). For the onnxruntime tuning experiments, `options` are `load_runner`'s (`optimization`,
    `batching`) and the session settings `SESSION_OPTIONS`: intra-op thread spinning
    (`session.intra_op.allow_spinning`), execution mode (`sequential`/`parallel`) and inter-op threads."""

    def __init__(self, spec: PeerSpec, **options: Any) -> None:
        super().__init__(spec)
        self.options = options

    def _load(self, inputs: BuildInputs) -> None:
        from pipeline.runtimes.record import model_file, read_variant
        from pipeline.runtimes.registry import load_runner

        assert self.spec.variant is not None
        directory = inputs.variants_root / self.spec.variant.split("+")[0]  # a tuning row: `<variant>+<tag>`
        try:
            info = read_variant(directory)
        except Exception as exc:
            raise PeerUnavailable(f"{directory} holds no built variant: {exc}") from exc
        if info.status != "ok":
            raise PeerUnavailable(f"variant {self.spec.variant} was {info.status}: {info.reason}")
        self.runner = load_runner(directory, inputs.threads,
                                  **{k: v for k, v in self.options.items() if k not in SESSION_OPTIONS})
        if any(k in self.options for k in SESSION_OPTIONS):
            self.runner.session = self._session(model_file(directory, info), inputs.threads)  # type: ignore[attr-defined]
        package = {"onnx": "onnxruntime"}.get(info.format, info.format)  # onnxruntime or openvino
        self.details["versions"] = {package: package_version(package)}
        self.details["scored_rows_alone"] = bool(getattr(self.runner, "rows_alone", False))
        for key in ("weight_format", "cls_readout"):
            if key in info.params:
                self.details[key] = info.params[key]
        if self.options:
            self.details["options"] = dict(self.options)

    def _session(self, path: Path, threads: int) -> Any:
        """A session like `pipeline.runtimes.ort.ort_session`'s with the `SESSION_OPTIONS` applied."""
        import onnxruntime as ort

        from pipeline.runtimes.ort import session_options

        opts = session_options(threads, self.options.get("optimization", "all"))
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = int(self.options.get("inter_op_threads", 1))
        if self.options.get("execution_mode") == "parallel":
            opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if "allow_spinning" in self.options:
            opts.add_session_config_entry("session.intra_op.allow_spinning",
                                          "1" if self.options["allow_spinning"] else "0")
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])

    def predict_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.runner(input_ids, attention_mask)


def runtime_for(spec: PeerSpec, **options: Any) -> PeerRuntime:
    """The runtime class of a row (not loaded yet)."""
    if spec.ours:
        return PipelineVariant(spec, **options)
    if spec.runtime.startswith("openvino"):
        return OpenVinoPeer(spec)
    return TorchPeer(spec)
