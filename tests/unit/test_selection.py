"""Unit: the selection rules return verdicts as data: the accuracy budget, evaluate's quantization targets, the
benchmark's latency target (over all INT8 variants and over quantization alone) and the variant package serves."""

from __future__ import annotations

import pytest

from pipeline.core.params import PackageParams, TargetsParams
from pipeline.selection import (
    SelectionError,
    Verdict,
    choose_variant,
    loss_pt,
    quantization_verdicts,
    speed_verdicts,
    within_budget,
)


def _scored(acc: float, size: float = 20.0) -> dict:
    return {"status": "ok", "accuracy": acc, "size_mb": size}


def test_auto_serves_the_most_accurate_in_the_window_unless_speed_is_preferred():
    variants = {"fp32-eager": _scored(0.900), "int8-dynamic": _scored(0.899), "int8-static": _scored(0.897),
                "int8-distilled": _scored(0.896, 10.0), "int8-qat": _scored(0.890)}  # qat: outside the window
    bench = {"int8-dynamic": {"p50_ms_b1": 4.0}, "int8-static": {"p50_ms_b1": 5.0},
             "int8-distilled": {"p50_ms_b1": 2.0}, "int8-qat": {"p50_ms_b1": 1.0}}
    assert choose_variant(variants, PackageParams(), TargetsParams(), bench).name == "int8-dynamic"
    fast = choose_variant(variants, PackageParams(prefer="speed"), TargetsParams(), bench)
    assert fast.name == "int8-distilled" and "prefer: speed" in fast.reason and "2.00 ms" in fast.reason
    with pytest.raises(Exception, match="needs batch-1 latencies"):
        choose_variant(variants, PackageParams(prefer="speed"), TargetsParams(), {})


def test_the_budget_is_inclusive_and_free_of_float_noise():
    targets = TargetsParams(max_accuracy_loss_pt=0.5)
    assert loss_pt(0.9, 0.895) == 0.5 and within_budget(0.9, 0.895, targets)  # 100 * 0.005 is 0.50000000000004
    assert not within_budget(0.9, 0.8949, targets)
    assert within_budget(0.9, 0.95, targets) and loss_pt(0.9, 0.95) == -5.0  # a gain is within any budget
    assert within_budget(None, 0.5, targets) and within_budget(0.9, None, targets)  # rows without accuracy count


def test_quantization_verdicts_are_values():
    results = {"fp32-eager": {"status": "ok", "accuracy": 0.90},
               "fp32-onnx": {"status": "ok", "accuracy": 0.90, "size_mb": 100.0},
               "int8-dynamic": {"status": "ok", "accuracy": 0.899, "size_mb": 26.0},
               "int8-static": {"status": "ok", "accuracy": 0.89, "size_mb": 40.0},
               "int8-qat": {"status": "ok", "accuracy": 0.891, "size_mb": 26.0},
               "tensorrt-int8": {"status": "skipped"}}
    got = {(v.variant, v.target): v for v in quantization_verdicts(results, TargetsParams())}
    assert got[("int8-dynamic", "accuracy_loss_pt")] == Verdict("int8-dynamic", "accuracy_loss_pt", 0.1, 0.5, True)
    assert got[("int8-static", "accuracy_loss_pt")].met is False
    assert got[("int8-static", "size_share")] == Verdict("int8-static", "size_share", 0.4, 0.3, False)
    assert got[("int8-qat", "qat_vs_static")] == Verdict("int8-qat", "qat_vs_static", 0.891, 0.89, True)
    assert not any(v.variant == "tensorrt-int8" for v in got.values())


def _timed(p50: float, acc: float = 0.90) -> dict:
    return {"status": "ok", "p50_ms_b1": p50, "speedup_p50_vs_fp32_eager": 10 / p50, "accuracy": acc}


def test_the_latency_verdict_takes_the_fastest_variant_within_the_budget():
    rows = {"fp32-eager": _timed(10.0), "int8-static": _timed(4.0, 0.899), "int8-dynamic": _timed(2.0, 0.85),
            "tensorrt-int8": {"status": "skipped"}}
    ((scope, v),) = speed_verdicts(rows, TargetsParams())
    # int8-dynamic is faster but loses 5 pt, so the best within the budget is int8-static at 2.5x: a miss
    assert scope == "all" and v.best == "int8-static" and v.speedup == 2.5 and v.within_budget and not v.met


def test_no_variant_within_the_budget_names_the_fastest_and_misses():
    rows = {"fp32-eager": _timed(10.0), "int8-static": _timed(4.0, 0.8), "int8-dynamic": _timed(2.0, 0.85)}
    ((_, v),) = speed_verdicts(rows, TargetsParams(min_speedup=1.0))
    assert v.best == "int8-dynamic" and not v.within_budget and not v.met


def test_an_interval_that_contains_the_target_straddles_it():
    rows = {"fp32-eager": _timed(10.0), "int8-dynamic": {**_timed(3.5, 0.898), "speedup_p50_low": 2.6,
                                                         "speedup_p50_high": 3.1}}
    ((_, v),) = speed_verdicts(rows, TargetsParams())
    assert v.straddles and not v.met
    rows["int8-dynamic"]["speedup_p50_high"] = 2.9
    assert not speed_verdicts(rows, TargetsParams())[0][1].straddles


def test_smaller_models_get_a_verdict_apart_from_quantization_alone():
    rows = {"fp32-eager": _timed(10.0), "int8-static": _timed(4.0, 0.899), "int8-dynamic": _timed(2.0, 0.85),
            "int8-pruned": _timed(3.0, 0.897)}
    (all_scope, overall), (plain_scope, plain) = speed_verdicts(rows, TargetsParams())
    assert (all_scope, overall.best, overall.met) == ("all", "int8-pruned", True)
    assert (plain_scope, plain.best, plain.met) == ("quantization", "int8-static", False)
    assert speed_verdicts({"fp32-eager": _timed(10.0)}, TargetsParams()) == []


def test_a_named_variant_must_be_servable_and_built():
    variants = {"fp32-eager": _scored(0.9), "int8-static": {"status": "skipped"}}
    with pytest.raises(SelectionError, match="not a variant the handler can serve"):
        choose_variant(variants, PackageParams(variant="tensorrt-int8"), TargetsParams())
    with pytest.raises(SelectionError, match="not an available variant"):
        choose_variant(variants, PackageParams(variant="int8-static"), TargetsParams())
    assert choose_variant({"fp32-eager": _scored(0.9)}, PackageParams(), TargetsParams()).name == "fp32-onnx"


def test_a_variant_the_test_set_cannot_tell_apart_from_the_most_accurate_is_tied_and_the_fastest_is_served():
    """Zen 3, 2026-11-25: int8-openvino 89.80 % at 34.5 ms was served over int8-dynamic 89.53 % at 18.3 ms, a
    difference of 4 reviews in 1,500. Tied by the paired test, the faster one is served, and the reason says so
    in numbers; a difference the test does resolve still goes to the most accurate."""
    from pipeline.selection import TIE_P_VALUE, mcnemar_p

    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(10, 10) == 1.0
    assert mcnemar_p(12, 8) > TIE_P_VALUE > mcnemar_p(30, 8)
    assert abs(mcnemar_p(3, 0) - 0.25) < 1e-12  # 2 * (1/2)^3

    def paired(only_ref: int, only_this: int) -> dict:
        return {"paired_reference": "int8-openvino", "paired_only_reference_right": only_ref,
                "paired_only_this_right": only_this, "paired_p_value": mcnemar_p(only_ref, only_this)}

    variants = {"fp32-eager": _scored(0.8980), "int8-openvino": {**_scored(0.8980), **paired(0, 0)},
                "int8-dynamic": {**_scored(0.8953), **paired(12, 8)}}
    bench = {"int8-openvino": {"p50_ms_b1": 34.5}, "int8-dynamic": {"p50_ms_b1": 18.3}}
    choice = choose_variant(variants, PackageParams(), TargetsParams(), bench)
    assert choice.name == "int8-dynamic"
    assert "18.30 ms vs 34.50 ms" in choice.reason and "12 + 8 reviews" in choice.reason and "p = 0.50" in choice.reason
    variants["int8-dynamic"].update(paired(30, 8))  # a difference the test set resolves
    assert choose_variant(variants, PackageParams(), TargetsParams(), bench).name == "int8-openvino"
    variants["int8-dynamic"].update(paired(12, 8))
    assert choose_variant(variants, PackageParams(), TargetsParams(), {}).name == "int8-openvino"  # no timings
    bench["int8-openvino"]["p50_ms_b1"] = 10.0  # the most accurate is also the fastest of its ties
    kept = choose_variant(variants, PackageParams(), TargetsParams(), bench)
    assert kept.name == "int8-openvino" and "fastest at batch 1 (10.00 ms)" in kept.reason
    # the variants it was tied with, each in numbers: accuracy, speed and the paired test
    assert "int8-dynamic 89.53% at 18.30 ms, 12 + 8 reviews only one of the two gets right, p = 0.50" in kept.reason
