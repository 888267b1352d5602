"""Unit: the machine record a benchmark figure carries (ISA flags as this CPU reports them, threads used)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.core.machine import (
    ISA_FLAGS,
    cpu_flags,
    decision_tags,
    default_threads,
    isa_record,
    machine_info,
    resolve_bf16_row,
    resolve_distill,
    resolve_precision,
    resolve_qat_precision,
    resolve_weight_format,
    resolved_threads,
    thread_tags,
    training_attention,
)


def _cpuinfo_flags() -> set[str]:
    """The CPU's flags as the kernel lists them, read here independently of `machine_info`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line (not an x86 CPU)")


def test_machine_info_records_this_cpus_isa_flags_and_the_threads_used():
    flags = _cpuinfo_flags()
    info = machine_info(threads=3)
    assert info["threads_used"] == 3
    assert info["logical_cpus"] == os.cpu_count()
    # the flags that decide INT8 and bf16 speed are all reported, each as this CPU has it or not
    assert {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"} <= set(info["isa"])
    assert info["isa"] == {flag: flag in flags for flag in info["isa"]}


AVX2 = frozenset({"avx", "avx2", "fma"})
ZEN4 = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16"}
ALDER = AVX2 | {"avx_vnni"}
SAPPHIRE = AVX2 | {"avx512f", "avx512_vnni", "amx_int8", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize(("flags", "fmt"), [(AVX2, "u8"), (ZEN4, "s8"), (ALDER, "s8"), (SAPPHIRE, "s8")])
def test_weight_format_auto_is_signed_8_bit_only_with_int8_dot_products(flags, fmt):
    """Without VNNI/AMX signed 8-bit weights saturate onnxruntime's AVX2 U8S8 kernels: `auto` picks the exact
    unsigned 8-bit format there, signed 8-bit elsewhere."""
    choice = resolve_weight_format("auto", flags)
    assert choice.value == fmt and choice.asked == "auto" and choice.reason
    # an explicit value is kept whatever the CPU
    for explicit in ("s8", "s7", "u8"):
        assert resolve_weight_format(explicit, AVX2).value == explicit
        assert resolve_weight_format(explicit, ZEN4).value == explicit


@pytest.mark.parametrize(("flags", "precision"), [(AVX2, "32-true"), (ZEN4, "bf16-mixed"), (ALDER, "32-true"),
                                                  (SAPPHIRE, "bf16-mixed")])
def test_precision_auto_on_the_cpu_follows_native_bf16(flags, precision):
    assert resolve_precision("auto", "cpu", flags, cuda=False).value == precision
    assert resolve_precision("16-mixed", "cpu", flags, cuda=False).value == "16-mixed"


@pytest.mark.parametrize(("flags", "precision"), [(AVX2, "32-true"), (ZEN4, "bf16-mixed"), (ALDER, "32-true"),
                                                  (SAPPHIRE, "bf16-mixed")])
def test_qat_precision_auto_follows_native_bf16_and_an_explicit_value_is_kept(flags, precision):
    """QAT trains on the CPU: `quantize.qat_precision: auto` is bf16 exactly where the CPU has it natively."""
    choice = resolve_qat_precision("auto", flags)
    assert (choice.setting, choice.asked, choice.value) == ("quantize.qat_precision", "auto", precision)
    assert choice.reason.startswith("CPU has native bf16") is (precision == "bf16-mixed")
    for explicit in ("32-true", "bf16-mixed"):
        assert resolve_qat_precision(explicit, flags).value == explicit


@pytest.mark.parametrize(("precision", "accelerator", "cuda", "kernel"),
                         [("bf16-mixed", "cpu", False, "eager"), ("bf16-true", "cpu", True, "eager"),
                          ("32-true", "cpu", False, "as loaded"), ("bf16-mixed", "auto", True, "as loaded"),
                          ("16-mixed", "gpu", True, "as loaded"), ("bf16-mixed", "auto", False, "eager")])
def test_training_attention_is_eager_only_for_bf16_on_the_cpu(precision, accelerator, cuda, kernel):
    """PyTorch's CPU flash-attention backward is the slow part of a bf16 step; in fp32 and on CUDA the model keeps
    its fused kernel. The choice says why, and that no setting asked for it."""
    choice = training_attention(precision, accelerator, cuda=cuda)
    assert choice.value == kernel and choice.asked == "derived" and choice.setting == "train.attention"
    assert precision.split("-")[0] in choice.reason or "CUDA" in choice.reason


def test_bf16_benchmark_row_auto_only_with_native_bf16():
    assert resolve_bf16_row("auto", ZEN4).value is True
    assert resolve_bf16_row("auto", AVX2).value is False
    assert resolve_bf16_row(True, AVX2).value is True


@pytest.mark.parametrize(("flags", "trained"), [(AVX2, False), (ZEN4, True), (ALDER, False), (SAPPHIRE, True)])
def test_distill_auto_trains_the_student_only_where_training_is_accelerated(flags, trained):
    """`distill.enabled: auto` follows the precision the CPU trains in (an fp32 student does not fit the default
    budget) and is on wherever training runs on CUDA; an explicit value is kept."""
    precision = resolve_precision("auto", "cpu", flags, cuda=False).value
    choice = resolve_distill("auto", "cpu", precision, cuda=False)
    assert choice.value is trained and choice.asked == "auto"
    assert ("32-true" in choice.reason) is not trained
    assert resolve_distill("auto", "auto", "32-true", cuda=True).value is True  # a GPU even in fp32
    assert resolve_distill("auto", "cpu", "32-true", cuda=True).value is False  # CUDA present, training on the CPU
    assert resolve_distill(True, "cpu", "32-true", cuda=False).value is True
    assert resolve_distill(False, "cpu", "bf16-mixed", cuda=False).value is False


def test_choices_describe_themselves():
    choice = resolve_weight_format("auto", AVX2)
    assert choice.to_dict() == {"setting": "quantize.weight_format", "asked": "auto", "value": "u8",
                                "reason": choice.reason}
    assert choice.tag().startswith("u8 (asked auto: ")


def test_a_flags_override_rehearses_another_cpus_choices_and_every_record_says_so(monkeypatch):
    """`PIPELINE_CPU_FLAGS` replaces this CPU's flags in the `auto` decisions (each reason says so) while the
    records keep this CPU's real flags beside the ones decided with: a timing is never labelled with flags its
    kernels did not have."""
    real = _cpuinfo_flags()
    monkeypatch.setenv("PIPELINE_CPU_FLAGS", "avx, AVX2 fma")  # commas, spaces and case as a user may type them
    chosen = {"precision": resolve_precision("auto", "cpu", cuda=False), "weights": resolve_weight_format("auto"),
              "bf16_row": resolve_bf16_row("auto"), "distill": resolve_distill("auto", "cpu", "32-true", cuda=False),
              "qat": resolve_qat_precision("auto")}
    assert [c.value for c in chosen.values()] == ["32-true", "u8", False, False, "32-true"]
    assert all("PIPELINE_CPU_FLAGS" in c.reason for c in chosen.values())
    info = machine_info(threads=1)
    assert info["isa"] == {f: f in real for f in ISA_FLAGS}
    assert info["decided_with"] == {"source": "PIPELINE_CPU_FLAGS",
                                    "isa": {f: f in {"avx", "avx2", "fma"} for f in ISA_FLAGS}}
    assert decision_tags()["cpu.decided_with"].startswith("PIPELINE_CPU_FLAGS=avx avx2 fma (not this CPU's flags")
    # flags a caller passes win over the override; an explicit setting ignores both
    assert resolve_precision("auto", "cpu", ZEN4, cuda=False).value == "bf16-mixed"
    assert resolve_weight_format("s7").reason == "set explicitly"
    monkeypatch.setenv("PIPELINE_CPU_FLAGS", "avx2 avx512f avx512_vnni avx512_bf16")
    assert resolve_precision("auto", "cpu", cuda=False).value == "bf16-mixed"
    assert resolve_weight_format("auto").value == "s8"


@pytest.mark.parametrize("value", [None, "", " , "])
def test_without_an_override_the_decisions_use_this_cpus_flags_and_say_nothing_of_it(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("PIPELINE_CPU_FLAGS", raising=False)
    else:
        monkeypatch.setenv("PIPELINE_CPU_FLAGS", value)
    assert "decided_with" not in isa_record() and decision_tags() == {}
    for auto, on_these_flags in ((resolve_precision("auto", "cpu", cuda=False),
                                  resolve_precision("auto", "cpu", cpu_flags(), cuda=False)),
                                 (resolve_weight_format("auto"), resolve_weight_format("auto", cpu_flags())),
                                 (resolve_bf16_row("auto"), resolve_bf16_row("auto", cpu_flags())),
                                 (resolve_qat_precision("auto"), resolve_qat_precision("auto", cpu_flags()))):
        assert auto == on_these_flags and "PIPELINE_CPU_FLAGS" not in auto.reason


@pytest.mark.parametrize(("value", "expected"), [("4", 4), (" 1 ", 1), ("0", None), ("-2", None), ("two", None),
                                                 ("", None), (None, None)])
def test_the_omp_cap_is_read_only_where_it_is_a_positive_count(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_threads() == expected
    assert thread_tags()["threads.cap"] == (value or "unset")


@pytest.mark.parametrize(("cap", "setting", "expected"), [(None, None, None), (None, 4, 4), ("2", None, 2),
                                                          ("2", 4, 2), ("8", 4, 4)])
def test_a_thread_setting_is_capped_by_the_omp_cap_where_one_is_set(monkeypatch, cap, setting, expected):
    from pipeline.core.machine import capped_threads

    if cap is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", cap)
    assert capped_threads(setting) == expected


def test_a_null_thread_setting_counts_the_cpus_this_process_may_use(monkeypatch):
    """Null and no OMP cap: the affinity mask's CPUs (a `taskset` or container cpuset), not the machine's count."""
    from pipeline.core import machine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {2, 5, 7})
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 64)
    assert resolved_threads(None) == 3 and resolved_threads(8) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolved_threads(None) == 2


def test_resolving_auto_on_a_cpu_accelerator_does_not_import_torch():
    """Every stage resolves `auto` before its work; with `train.accelerator: cpu` (the default) the CUDA question
    has its answer without torch, so stages that never use torch (prepare, package, the skipped ones) do not pay
    its import. Run in a fresh interpreter: this test session has torch loaded already."""
    import subprocess
    import sys

    code = ("import sys\nfrom pipeline.core.params import Params, TrainParams, resolve_auto\n"
            "resolve_auto(Params(train=TrainParams(accelerator='cpu', precision='auto')))\n"
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("accelerator", "cuda", "expected"), [
    ("cpu", True, False), ("auto", True, True), ("gpu", True, True), ("cuda", True, True), ("auto", False, False)])
def test_trains_on_cuda_only_where_the_accelerator_allows_a_visible_gpu(accelerator, cuda, expected):
    from pipeline.core.machine import trains_on_cuda

    assert trains_on_cuda(accelerator, cuda) is expected


def test_no_nvidia_driver_path_means_no_cuda_without_asking_torch(tmp_path):
    import platform

    from pipeline.core.machine import nvidia_driver_absent

    missing = (str(tmp_path / "nvidiactl"), str(tmp_path / "dxg"))
    assert nvidia_driver_absent(missing) is (platform.system() == "Linux")
    (tmp_path / "dxg").touch()  # any one of them present: only CUDA itself can tell
    assert nvidia_driver_absent(missing) is False


def test_stages_that_skip_by_default_import_neither_torch_nor_lightning():
    """prune, distill and tensorrt are skipped by the default profile on a machine without a GPU: their modules
    import the builders (torch, Lightning) only where there is something to build, and TensorRT's availability
    is answered without torch where no NVIDIA driver is visible; the threading tags every stage run gets ask torch
    only where it is loaded. A fresh interpreter: this session has them."""
    import subprocess
    import sys

    from pipeline.core.machine import nvidia_driver_absent

    code = ("import sys\nimport pipeline.variants.prune, pipeline.variants.distilled, pipeline.training.distill\n"
            "from pipeline.core.machine import thread_tags\nfrom pipeline.variants.tensorrt import availability\n"
            "assert thread_tags()['threads.torch_intra_op'] == 'torch not loaded'\n"
            f"{'availability()' if nvidia_driver_absent() else ''}\n"
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
