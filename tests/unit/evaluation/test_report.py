"""Unit: the benchmark report: table rows (skipped, intervals) and the target lines."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.params import TargetsParams
from pipeline.evaluation.charts import pareto_chart
from pipeline.evaluation.report import (
    markdown_table,
    pareto_front,
    speedup_sources,
    speedup_sources_lines,
    target_lines,
)


def _row(p50: float, acc: float | None = 0.9) -> dict:
    return {"status": "ok", "reason": "", "p50_ms_b1": p50, "p95_ms_b1": p50 * 1.2, "p99_ms_b1": p50 * 1.5,
            "throughput_b32": 100 / p50, "speedup_p50_vs_fp32_eager": 10 / p50, "accuracy": acc, "size_mb": 20.0}


def test_skipped_rows_and_targets_in_report():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "tensorrt-int8": {"status": "skipped", "reason": "no CUDA device visible"}}
    table = markdown_table(variants)
    assert "| tensorrt-int8 | skipped: no CUDA device visible |" in table
    assert "2.50x" in table
    (line,) = target_lines(variants, TargetsParams())
    # the verdict itself is `pipeline.selection`'s (tests/unit/test_selection.py); the line renders it
    assert "**int8-static**" in line and "**2.50x**" in line
    assert line.endswith("(MISSED: target >= 3.0x within 0.5 pt).")


def test_speedup_interval_in_table_and_target_line():
    variants = {"fp32-eager": _row(10.0), "int8-dynamic": _row(3.5, 0.898)}
    variants["int8-dynamic"].update(speedup_p50_low=2.6, speedup_p50_high=3.1)
    table = markdown_table(variants)
    assert "2.86x (2.60-3.10)" in table and "90 % interval" in table
    (line,) = target_lines(variants, TargetsParams())
    assert "2.60-3.10x" in line and "straddles 3.0x" in line
    variants["int8-dynamic"].update(speedup_p50_high=2.9)
    assert "straddles" not in target_lines(variants, TargetsParams())[0]


def test_pruned_variant_target_stated_apart_from_quantization_alone():
    variants = {"fp32-eager": _row(10.0), "int8-static": _row(4.0, 0.899), "int8-dynamic": _row(2.0, 0.85),
                "int8-pruned": _row(3.0, 0.897)}
    overall, plain = target_lines(variants, TargetsParams())
    assert "**int8-pruned** (structured pruning + INT8" in overall and "3.33x" in overall
    assert "-0.30 pt" in overall
    assert plain.startswith("quantization alone (no pruning or distillation): ")
    assert "**int8-static**" in plain and "2.50x" in plain


def test_distilled_variant_target_stated_apart_and_named_as_a_smaller_model():
    variants = {"fp32-eager": _row(10.0), "int8-dynamic": _row(4.0, 0.899), "int8-distilled": _row(2.5, 0.897)}
    overall, plain = target_lines(variants, TargetsParams())
    assert "**int8-distilled** (distilled student + INT8: a smaller model" in overall
    assert plain.startswith("quantization alone (no pruning or distillation): ") and "int8-dynamic" in plain


def test_pareto_front_keeps_only_the_undominated_rows(tmp_path):
    variants = {"fp32-eager": _row(10.0, 0.90), "fp32-onnx": _row(5.0, 0.90), "int8-static": _row(4.0, 0.895),
                "int8-qat": _row(4.5, 0.89),  # slower and less accurate than int8-static: dominated
                "int8-distilled": _row(2.0, 0.893), "fp32-torchscript": _row(9.0, 0.90),
                "tensorrt-int8": {"status": "skipped", "reason": "no CUDA"}}
    assert pareto_front(variants) == ["int8-distilled", "int8-static", "fp32-onnx"]
    pareto_chart(variants, TargetsParams(), tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000


def test_speedup_sources_multiply_to_the_students_speedup():
    variants = {"fp32-eager": _row(20.0), "fp32-eager-readout": _row(16.0), "fp32-onnx": _row(8.0),
                "int8-dynamic": _row(4.0), "int8-distilled": _row(2.0)}
    steps = speedup_sources(variants)
    assert [round(s["factor"], 3) for s in steps] == [1.25, 2.0, 2.0, 2.0]
    assert float(np.prod([s["factor"] for s in steps])) == pytest.approx(20.0 / 2.0)
    assert "Product: 10.00x (fp32-eager -> int8-distilled)" in "\n".join(speedup_sources_lines(variants))
    variants["int8-distilled"] = {"status": "skipped", "reason": "distill.enabled is false"}
    assert [s["to"] for s in speedup_sources(variants)] == ["fp32-eager-readout", "fp32-onnx", "int8-dynamic"]


@pytest.mark.parametrize("rehearsed", [False, True])
def test_machine_section_states_the_isa_and_a_rehearsal_of_other_flags(tmp_path, rehearsed):
    """The report's machine section lists this CPU's flags; where `PIPELINE_CPU_FLAGS` made the `auto` decisions
    it also says so, with the flags decided with, and that the timings ran on this CPU. No VNNI: the AVX2 note."""
    from pipeline.evaluation.report import write_report

    machine = {"cpu": "Test CPU", "logical_cpus": 2, "threads_used": 2, "versions": {"onnxruntime": "x"},
               "isa": {"avx2": True, "avx512_vnni": False, "avx512_bf16": False}}
    if rehearsed:
        machine["decided_with"] = {"source": "PIPELINE_CPU_FLAGS",
                                   "isa": {"avx2": True, "avx512_vnni": True, "avx512_bf16": False}}
    result = {"variants": {"fp32-eager": _row(10.0), "int8-dynamic": _row(3.0)}, "machine": machine,
              "settings": {"seq_len": 128, "batch_size": 32, "rounds": 2, "iterations": 10, "warmup": 2}}
    path = tmp_path / "variants.md"
    write_report(result, tmp_path / "latency.png", path, TargetsParams())
    text = path.read_text()
    assert "- ISA: avx2=yes, avx512_vnni=no, avx512_bf16=no" in text
    assert "neither VNNI nor AMX" in text  # this CPU's kernels decide the note, not the rehearsed flags
    line = [x for x in text.splitlines() if "decided with" in x]
    if rehearsed:
        assert line == ["- `auto` settings decided with PIPELINE_CPU_FLAGS's flags, not this CPU's: avx2=yes, "
                        "avx512_vnni=yes, avx512_bf16=no (a rehearsal of another CPU's choices; the kernels timed "
                        "above ran on this CPU's ISA)"]
    else:
        assert line == []


@pytest.mark.parametrize(("vnni", "formats", "warned"), [(False, ("u8",), False), (False, ("u8", "s8"), True),
                                                         (True, ("s8",), False), (True, (), False)])
def test_machine_section_names_the_int8_weight_format_and_warns_of_s8_without_vnni(tmp_path, vnni, formats,
                                                                                 warned):
    """The INT8 weight formats the variants were built with are listed; signed 8-bit weights timed on a CPU
    without VNNI/AMX (whose U8S8 kernels saturate) are called out, an exact format is not."""
    from pipeline.evaluation.report import write_report

    machine = {"cpu": "Test CPU", "logical_cpus": 2, "threads_used": 2, "versions": {"onnxruntime": "x"},
               "isa": {"avx2": True, "avx512_vnni": vnni}}
    variants = {"fp32-eager": _row(10.0)}
    for i, fmt in enumerate(formats):
        variants[f"int8-{i}"] = {**_row(3.0), "weight_format": fmt}
    result = {"variants": variants, "machine": machine,
              "settings": {"seq_len": 128, "batch_size": 32, "rounds": 2, "iterations": 10, "warmup": 2}}
    path = tmp_path / "variants.md"
    write_report(result, tmp_path / "latency.png", path, TargetsParams())
    text = path.read_text()
    listed = [x for x in text.splitlines() if x.startswith("- INT8 weight format:")]
    assert listed == ([f"- INT8 weight format: {', '.join(sorted(set(formats)))} (`quantize.weight_format`; each "
                       "variant's `variant.json` says how `auto` resolved)"] if formats else [])
    assert ("neither VNNI nor AMX" in text) is not vnni
    assert ("products are not exact here" in text) is warned
