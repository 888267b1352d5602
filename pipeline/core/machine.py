"""The machine a figure was measured on (CPU model, ISA flags that decide INT8/bf16 speed, threads, versions),
and the settings that follow it: `auto` values resolved from the CPU's flags at run time, with the reason
recorded next to what they built."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.core.settings.choices import WEIGHT_FORMATS as WEIGHT_FORMATS  # the one definition, re-exported

#: Flags that decide INT8 and bf16 speed, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
#: INT8 dot-product instructions: u8 x s8 products summed in int32, no int16 saturation (unlike AVX2 vpmaddubsw).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: Native bf16 arithmetic: without it bf16 autocast on the CPU is emulated and much slower than fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: Environment variable that replaces this CPU's flags in the `auto` decisions (space or comma separated, e.g.
#: "avx2 fma" for an AVX2-only CPU): it rehearses what the pipeline chooses and builds on another kind of CPU.
#: Only the decisions follow it: the kernels still run on this CPU's ISA, so every record also keeps this CPU's
#: real flags and says the decisions were made with others (`isa_record`).
FLAGS_OVERRIDE_ENV = "PIPELINE_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as the kernel lists them (empty where /proc/cpuinfo is missing or lists none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpuinfo_value(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo (empty where the file or the key is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo_value("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel lists it (`GenuineIntel`, `AuthenticAMD`, ...; empty where unknown)."""
    return _cpuinfo_value("vendor_id")


def flags_override() -> frozenset[str] | None:
    """The flags `PIPELINE_CPU_FLAGS` names (None where it is unset or empty)."""
    raw = os.environ.get(FLAGS_OVERRIDE_ENV, "").replace(",", " ").split()
    return frozenset(f.lower() for f in raw) if raw else None


def decision_flags() -> tuple[frozenset[str], str]:
    """The flags the `auto` settings decide with, and a note for their reason when they are not this CPU's."""
    override = flags_override()
    if override is None:
        return cpu_flags(), ""
    return override, f" [flags from {FLAGS_OVERRIDE_ENV}, not this CPU's]"


def decision_tags() -> dict[str, str]:
    """MLflow tags that mark a run whose `auto` settings were decided with `PIPELINE_CPU_FLAGS` (none otherwise),
    so a rehearsal is never mistaken for a run on such a CPU."""
    override = flags_override()
    if override is None:
        return {}
    return {"cpu.decided_with": f"{FLAGS_OVERRIDE_ENV}={' '.join(sorted(override))} (not this CPU's flags: "
                                f"{cpu_model()})"}


#: The usual cap on a process's compute threads (OpenMP's; job schedulers, containers and `make test`'s parallel
#: workers set it). torch reads it itself; onnxruntime and OpenVINO do not, so `default_threads` hands it to them.
THREAD_CAP_ENV = "OMP_NUM_THREADS"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which `taskset` and container cpusets narrow), or the
    machine's CPU count where the platform has no affinity call."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads() -> int | None:
    """The intra-op threads of a runtime whose `*.threads` setting is null: `OMP_NUM_THREADS` where it is a positive
    integer, so one cap holds for torch, onnxruntime and OpenVINO alike; else None (each runtime's own default)."""
    raw = os.environ.get(THREAD_CAP_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def capped_threads(setting: int | None) -> int | None:
    """A `*.threads` setting lowered to the `OMP_NUM_THREADS` cap where one is set (None: the cap itself, or the
    runtime's own default). For a model loaded where the caller decides the cores (a Spark task's `spark.task.cpus`,
    which its executor hands on as the cap), so a count chosen for one serving process does not put many of
    them on every core at once."""
    cap = default_threads()
    if cap is None:
        return setting
    return cap if setting is None else min(setting, cap)


def resolved_threads(setting: int | None) -> int:
    """The intra-op threads a `*.threads` setting stands for where a count is needed (the benchmark's runtimes and
    record, evaluate's concurrent callers): the setting where set, else the `OMP_NUM_THREADS` cap where set, else
    every CPU this process may run on (`available_cpus`: a `taskset` or container cpuset narrows it, where
    `os.cpu_count` would still count the whole machine)."""
    return setting or default_threads() or available_cpus()


def thread_tags() -> dict[str, str]:
    """The threading a stage starts with, as MLflow tags: the CPUs this process may use, the `OMP_NUM_THREADS` cap,
    torch's intra-op threads (`torch_thread_tag`), and the tokenizers' parallelism. onnxruntime and OpenVINO use
    `*.threads` where set, else the cap where set (`default_threads`), else their own default (one per physical
    core)."""
    return {"threads.cpus_available": str(available_cpus()),
            "threads.cap": os.environ.get(THREAD_CAP_ENV) or "unset",
            **torch_thread_tag(),
            "threads.tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset")}


def torch_thread_tag() -> dict[str, str]:
    """torch's intra-op threads (its default is one per physical core, or the cap; `*.threads` settings replace
    it) where this process has loaded torch, else "torch not loaded": asking would import it, which costs a stage
    that never uses torch (prepare, package, a skipped builder) seconds."""
    torch = sys.modules.get("torch")
    return {"threads.torch_intra_op": str(torch.get_num_threads()) if torch is not None else "torch not loaded"}


def isa_record(flags: frozenset[str] | None = None) -> dict[str, Any]:
    """CPU model and the flags that matter, each as this CPU has it or not; where `PIPELINE_CPU_FLAGS` replaced
    them in the decisions, also the flags decided with (`decided_with`)."""
    have = cpu_flags() if flags is None else flags
    record: dict[str, Any] = {"cpu": cpu_model(), "isa": {f: f in have for f in ISA_FLAGS}}
    override = flags_override()
    if override is not None:
        record["decided_with"] = {"source": FLAGS_OVERRIDE_ENV, "isa": {f: f in override for f in ISA_FLAGS}}
    return record


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model, ISA flags that matter for INT8/bf16, thread settings and library versions."""
    versions = {}
    for mod in ("torch", "onnxruntime", "onnx", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "absent"
    return {**isa_record(), "logical_cpus": os.cpu_count(), "threads_used": threads,
            "python": platform.python_version(), "versions": versions}


@dataclass(frozen=True)
class Choice:
    """What a setting asked for, what it resolved to on this machine, and why."""

    setting: str
    asked: Any
    value: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tag(self) -> str:
        """One line for an MLflow tag or a log message."""
        return f"{self.value} (asked {self.asked}: {self.reason})"


def _present(flags: frozenset[str], wanted: tuple[str, ...]) -> list[str]:
    return [f for f in wanted if f in flags]


def _decide_with(flags: frozenset[str] | None) -> tuple[frozenset[str], str]:
    """`flags` where a caller passes them, else the decision flags (this CPU's or the override's) and their note."""
    return (flags, "") if flags is not None else decision_flags()


#: Where a Linux host with an NVIDIA driver shows it: the driver's control device, its /proc entry, or WSL2's GPU
#: paravirtualisation device. None of them present means no CUDA device, without importing torch to ask.
NVIDIA_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


def nvidia_driver_absent(paths: tuple[str, ...] = NVIDIA_DRIVER_PATHS) -> bool:
    """True where no NVIDIA driver is visible on Linux (none of `paths` exists): there can be no CUDA device.
    False elsewhere, and on other systems, where only CUDA itself can tell."""
    return platform.system() == "Linux" and not any(os.path.exists(p) for p in paths)


def trains_on_cuda(accelerator: str, cuda: bool | None = None) -> bool:
    """Whether work that follows `train.accelerator` runs on a CUDA device: `auto`, `gpu` or `cuda` where one is
    visible (`cuda`, default: ask torch, which is imported only when the accelerator could be CUDA: a stage that
    never touches torch does not pay its import to learn that `cpu` means the CPU)."""
    if accelerator not in ("auto", "gpu", "cuda"):
        return False
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return cuda


#: Why a bf16 choice falls back on a CPU without native bf16 (`_by_native_bf16`'s default).
_EMULATED_BF16 = "CPU has no native bf16 (no AVX512-BF16/AMX): bf16 is emulated"


def _by_native_bf16(setting: str, asked: Any, flags: frozenset[str] | None, native: Any, emulated: Any,
                   emulated_reason: str = _EMULATED_BF16) -> Choice:
    """`setting`'s `auto` decided by the CPU's native bf16 (AVX512-BF16 or AMX, in `flags` or this CPU's):
    `native` where it has it, else `emulated`, each with its reason (and the flags override's note)."""
    flags, note = _decide_with(flags)
    have = _present(flags, BF16_FLAGS)
    if have:
        return Choice(setting, asked, native, f"CPU has native bf16 ({', '.join(have)}){note}")
    return Choice(setting, asked, emulated, f"{emulated_reason}{note}")


def resolve_precision(asked: str, accelerator: str, flags: frozenset[str] | None = None,
                      cuda: bool | None = None) -> Choice:
    """`train.precision`. `auto`: on CUDA bf16-mixed where the GPU supports it, else 16-mixed; on the CPU
    bf16-mixed where the CPU has native bf16 (AVX512-BF16 or AMX), else 32-true."""
    if asked != "auto":
        return Choice("train.precision", asked, asked, "set explicitly")
    if trains_on_cuda(accelerator, cuda):
        import torch

        if torch.cuda.is_bf16_supported():
            return Choice("train.precision", asked, "bf16-mixed", "CUDA device with bf16 support")
        return Choice("train.precision", asked, "16-mixed", "CUDA device without bf16 support")
    return _by_native_bf16("train.precision", asked, flags, "bf16-mixed", "32-true")


def resolve_qat_precision(asked: str, flags: frozenset[str] | None = None) -> Choice:
    """`quantize.qat_precision` (QAT trains on the CPU whatever `train.accelerator` says). `auto`: bf16-mixed where
    the CPU has native bf16 (AVX512-BF16 or AMX), else 32-true: emulated bf16 would be slower than fp32."""
    if asked != "auto":
        return Choice("quantize.qat_precision", asked, asked, "set explicitly")
    return _by_native_bf16("quantize.qat_precision", asked, flags, "bf16-mixed", "32-true")


def training_attention(precision: str, accelerator: str, cuda: bool | None = None) -> Choice:
    """The attention kernel a training job runs (`train.attention`, derived: no setting asks for it) for its
    resolved `train.precision` on this machine: `eager` (Hugging Face's matrix products and softmax) for bf16 on the
    CPU, else `as loaded` (the model's own, PyTorch's `scaled_dot_product_attention` for the models here). Why:
    PyTorch's CPU flash-attention backward is slow in bf16, where it takes a large share of a step, while in fp32
    and on CUDA the fused kernel is the faster one (docs/training.md, "Attention in training" has the
    measurements). Inference keeps the model's own either way."""
    on_cuda = trains_on_cuda(accelerator, cuda)
    if not on_cuda and precision.startswith("bf16"):
        return Choice("train.attention", "derived", "eager",
                      "bf16 on the CPU: PyTorch's flash-attention backward is slower there than eager attention")
    where = "CUDA" if on_cuda else f"{precision} on the CPU"
    return Choice("train.attention", "derived", "as loaded", f"{where}: the model's fused attention is the faster")


def resolve_weight_format(asked: str, flags: frozenset[str] | None = None) -> Choice:
    """`quantize.weight_format`. Without INT8 dot products (VNNI/AMX) onnxruntime's U8S8 kernels multiply with
    AVX2 `vpmaddubsw`, which sums byte pairs in int16 and saturates, so 8-bit signed weights give wrong products
    there. `auto`: `s8` where the CPU has VNNI/AMX (exact, the fastest kernels), else `u8`, whose U8U8 kernels
    multiply in 16 bits and are exact at full 8-bit resolution; `s7` is also exact there, one bit coarser
    (RESULTS.md has the accuracy each format measured)."""
    if asked != "auto":
        return Choice("quantize.weight_format", asked, asked, "set explicitly")
    flags, note = _decide_with(flags)
    have = _present(flags, INT8_DOT_FLAGS)
    if have:
        return Choice("quantize.weight_format", asked, "s8", f"CPU has INT8 dot products ({', '.join(have)}): "
                                                            f"signed 8-bit weights are exact{note}")
    return Choice("quantize.weight_format", asked, "u8", "CPU lacks VNNI/AMX: signed 8-bit weights can saturate "
                                                         "int16 pair sums (AVX2 vpmaddubsw), so weights are unsigned "
                                                         f"8-bit on the U8U8 kernels{note}")


def resolve_distill(asked: bool | str, accelerator: str, precision: str, cuda: bool | None = None) -> Choice:
    """`distill.enabled`. `auto`: the student is trained where training is accelerated (on CUDA, or on a CPU in a
    reduced precision: `precision`, the resolved `train.precision`) and skipped where it would train in fp32 on the
    CPU: there it costs several times the teacher's own finetune, more than a whole default `make run` (RESULTS.md
    has the measured stage times); `true` trains it anyway."""
    if asked != "auto":
        return Choice("distill.enabled", asked, bool(asked), "set explicitly")
    if trains_on_cuda(accelerator, cuda):
        return Choice("distill.enabled", asked, True, "training runs on a CUDA device")
    note = decision_flags()[1]
    if precision != "32-true":
        return Choice("distill.enabled", asked, True, f"the CPU trains in {precision}{note}")
    return Choice("distill.enabled", asked, False,
                  "the CPU trains in 32-true (no native bf16): the student's fp32 training would take longer than "
                  f"a whole default make run; set distill.enabled: true to train it anyway{note}")


def resolve_bf16_row(asked: bool | str, flags: frozenset[str] | None = None) -> Choice:
    """`benchmark.bf16_row`. `auto`: measure FP32 weights under bf16 autocast only where bf16 is native."""
    if asked != "auto":
        return Choice("benchmark.bf16_row", asked, bool(asked), "set explicitly")
    return _by_native_bf16("benchmark.bf16_row", asked, flags, True, False,
                          "CPU has no native bf16: the row would only show emulation")
