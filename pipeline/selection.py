"""Which variants meet the targets, as data: the one accuracy-budget rule (`within_budget`: within
`targets.max_accuracy_loss_pt` of FP32), the quantization verdicts evaluate states, the latency verdict the
benchmark report states, and the variant package serves. Callers render the returned values; nothing here
writes prose but the served variant's reason."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import UserError
from pipeline.core.params import PackageParams, TargetsParams
from pipeline.runtimes.catalog import REFERENCE, VARIANTS, UnknownVariant, spec

Results = Mapping[str, Mapping[str, Any]]


class SelectionError(UserError):
    """The variant named in params, or the data `prefer: speed` needs, is not there."""


def loss_pt(reference_accuracy: float, accuracy: float) -> float:
    """Accuracy points lost against the reference (negative: a gain), free of float noise past 6 decimals."""
    return round(100 * (reference_accuracy - accuracy), 6)


def within_budget(reference_accuracy: float | None, accuracy: float | None, targets: TargetsParams) -> bool:
    """The rule: a variant counts when it loses at most `targets.max_accuracy_loss_pt` against FP32. A row with no
    accuracy on either side (a timing row, or a benchmark read without evaluate's numbers) is not excluded."""
    if reference_accuracy is None or accuracy is None:
        return True
    return loss_pt(reference_accuracy, accuracy) <= targets.max_accuracy_loss_pt


@dataclass(frozen=True)
class Verdict:
    """One target for one variant: what was measured, the bound, and whether it was met."""

    variant: str
    target: str  # accuracy_loss_pt | size_share | qat_vs_static
    value: float
    bound: float
    met: bool
    tie_p_value: float | None = None  # qat_vs_static: McNemar's p on the same reviews

    @property
    def unresolved(self) -> bool:
        """Missed by a difference the test set cannot resolve: a paired p of `TIE_P_VALUE` or more, a tie."""
        return not self.met and self.tie_p_value is not None and self.tie_p_value >= TIE_P_VALUE


def quantization_verdicts(results: Results, targets: TargetsParams) -> list[Verdict]:
    """Evaluate's targets for each built INT8-family variant: accuracy loss within the budget, size at most
    `targets.max_size_share` of fp32-onnx; and QAT at least as accurate as static INT8 when both were built, with
    the paired test of the two on the same reviews where evaluate recorded it (`vs_static_p_value`)."""
    out: list[Verdict] = []
    reference = results[REFERENCE]["accuracy"]
    fp32_onnx = results.get("fp32-onnx", {}).get("size_mb")
    for name in [v.name for v in VARIANTS if v.family == "int8"]:
        e = results.get(name)
        if not e or e.get("status") != "ok":
            continue
        out.append(Verdict(name, "accuracy_loss_pt", loss_pt(reference, e["accuracy"]), targets.max_accuracy_loss_pt,
                           within_budget(reference, e["accuracy"], targets)))
        if fp32_onnx:
            share = e["size_mb"] / fp32_onnx
            out.append(Verdict(name, "size_share", share, targets.max_size_share, share <= targets.max_size_share))
    s, q = results.get("int8-static"), results.get("int8-qat")
    if s and q and s.get("status") == q.get("status") == "ok":
        out.append(Verdict("int8-qat", "qat_vs_static", q["accuracy"], s["accuracy"], q["accuracy"] >= s["accuracy"],
                           q.get("vs_static_p_value")))
    return out


@dataclass(frozen=True)
class SpeedVerdict:
    """The latency target over a pool of INT8 variants: the fastest one within the accuracy budget (or, when none
    is, the fastest at all), its batch-1 speed-up over FP32 eager, and whether the target was met."""

    best: str
    speedup: float
    min_speedup: float
    within_budget: bool  # some variant of the pool is within the budget (`best` is one of them)
    met: bool
    straddles: bool  # the speed-up's interval over the rounds contains the target: another run could flip it


def speed_verdict(rows: Results, pool: Results, targets: TargetsParams) -> SpeedVerdict:
    """The latency verdict over `pool` (rows of `rows`, each with `speedup_p50_vs_fp32_eager`)."""
    reference = rows[REFERENCE].get("accuracy")
    eligible = {n: e for n, e in pool.items() if within_budget(reference, e.get("accuracy"), targets)}
    candidates = eligible or pool
    best = max(candidates, key=lambda n: candidates[n]["speedup_p50_vs_fp32_eager"])
    row = candidates[best]
    speedup = row["speedup_p50_vs_fp32_eager"]
    low, high = row.get("speedup_p50_low"), row.get("speedup_p50_high")
    straddles = low is not None and high is not None and low < targets.min_speedup <= high
    return SpeedVerdict(best, speedup, targets.min_speedup, bool(eligible),
                        speedup >= targets.min_speedup and bool(eligible), straddles)


#: Each QAT variant judged against the post-training variant of the same runtime, which it should at least match in
#: speed (issue 43: QAT on the runtime that runs INT8 fastest). int8-qat is not: its graph is int8-static's, op for
#: op, so their speeds differ only by noise (evaluate's `qat_vs_static` compares their accuracy).
QAT_PAIRS: tuple[tuple[str, str], ...] = (("int8-qat-openvino", "int8-openvino"),)

#: The onnxruntime recipes with calibrated (static) activation scales against the one that computes them per batch
#: (issue 43: static PTQ and QAT should be at least as fast as int8-dynamic at batch 1, within the accuracy budget).
STATIC_PAIRS: tuple[tuple[str, str], ...] = (("int8-static", "int8-dynamic"), ("int8-qat", "int8-dynamic"))

#: Every pair whose batch-1 ratio the benchmark measures paired by round (`b1_vs_baseline_low`/`_high` on the first
#: one's row); each variant is the first of at most one pair.
SPEED_PAIRS: tuple[tuple[str, str], ...] = QAT_PAIRS + STATIC_PAIRS


#: How many paired standard errors either side of an accuracy difference still count as noise (a 95 % interval).
NOISE_Z = 1.96


@dataclass(frozen=True)
class PairVerdict:
    """A variant against FP32's accuracy and a baseline variant's speed (a pair of `SPEED_PAIRS`): within
    `max_loss_pt` of FP32 and at least as fast as the baseline at batch 1 and, where `batched` was judged, at the
    benchmark's batch size."""

    variant: str
    baseline: str
    delta_pt: float  # accuracy against FP32 eager, in points
    max_loss_pt: float
    b1: float  # the baseline's batch-1 p50 over the variant's: above 1, the variant is faster
    b1_low: float | None  # the paired bootstrap interval of `b1` over the benchmark's rounds (None: not measured)
    b1_high: float | None
    batched: float | None  # the variant's throughput at the benchmark's batch size over the baseline's (None: not
    # part of this target)
    within_noise: bool  # the batch-1 order is within noise: another run could order them the other way
    met: bool  # on the point estimates; `within_noise` and `accuracy_within_noise` say which half is within noise
    delta_se_pt: float | None = None  # the paired standard error of `delta_pt` (None: not recorded)
    accuracy_within_noise: bool = False  # the loss bound lies inside `delta_pt`'s 95 % interval (`NOISE_Z`)

    @property
    def could_flip(self) -> bool:
        """Whether another run (or another test set) could give the other verdict: a met target whose accuracy or
        batch-1 half is within noise; a missed one whose every failing half is (the batched ratio has no interval,
        so a miss there counts as resolved)."""
        if self.met:
            return self.accuracy_within_noise or self.within_noise
        accuracy_ok = -self.delta_pt <= self.max_loss_pt
        batched_ok = self.batched is None or self.batched >= 1.0
        return (accuracy_ok or self.accuracy_within_noise) and batched_ok and (self.b1 >= 1.0 or self.within_noise)


def pair_verdicts(rows: Results, pairs: tuple[tuple[str, str], ...], max_loss_pt: float,
                  batched: bool) -> list[PairVerdict]:
    """One verdict per pair of `pairs` whose two rows were measured and the first one scored: within `max_loss_pt`
    of FP32 and at least as fast as the baseline at batch 1 and, with `batched`, at the benchmark's batch
    (`benchmark.batch_size`, whose throughput is in `throughput_b32`). The accuracy half is within noise where the
    bound lies inside the 95 % interval of the paired difference (`accuracy_delta_se_pt`, evaluate's): on 1,500
    test reviews one standard error is about 0.2 point, so a verdict on a 0.2-point bound is then the test set's
    draw, and the report says so."""
    reference = rows.get(REFERENCE, {}).get("accuracy")
    out = []
    for name, baseline in pairs:
        q, b = rows.get(name, {}), rows.get(baseline, {})
        if reference is None or q.get("status") != "ok" or b.get("status") != "ok" or q.get("accuracy") is None:
            continue
        loss = loss_pt(reference, q["accuracy"])
        b1 = b["p50_ms_b1"] / q["p50_ms_b1"]
        ratio = q["throughput_b32"] / b["throughput_b32"] if batched else None
        low, high = q.get("b1_vs_baseline_low"), q.get("b1_vs_baseline_high")
        if low is not None and high is not None:  # the benchmark's paired interval of this very ratio
            within_noise = low <= 1.0 <= high
        else:  # rows without it: whether each one's interval against FP32 overlaps the other's
            within_noise = all(k in e for e in (q, b) for k in ("speedup_p50_low", "speedup_p50_high")) and (
                q["speedup_p50_low"] <= b["speedup_p50_high"] and b["speedup_p50_low"] <= q["speedup_p50_high"])
        se = q.get("accuracy_delta_se_pt")  # `0.0 - loss` below: a loss of 0.0 is +0.00, never -0.00
        accuracy_noise = se is not None and abs(loss - max_loss_pt) <= NOISE_Z * se
        met = loss <= max_loss_pt and b1 >= 1.0 and (ratio is None or ratio >= 1.0)
        out.append(PairVerdict(name, baseline, 0.0 - loss, max_loss_pt, b1, low, high, ratio, within_noise, met, se,
                               accuracy_noise))
    return out


def qat_verdicts(rows: Results, targets: TargetsParams) -> list[PairVerdict]:
    """Each QAT variant of `QAT_PAIRS` within `targets.qat_max_loss_pt` of FP32 and at least as fast as its
    runtime's post-training variant at batch 1 and at the benchmark's batch."""
    return pair_verdicts(rows, QAT_PAIRS, targets.qat_max_loss_pt, batched=True)


def static_verdicts(rows: Results, targets: TargetsParams) -> list[PairVerdict]:
    """Each static-scale recipe of `STATIC_PAIRS` within the accuracy budget (`targets.max_accuracy_loss_pt`) and
    at least as fast as int8-dynamic at batch 1."""
    return pair_verdicts(rows, STATIC_PAIRS, targets.max_accuracy_loss_pt, batched=False)


def smaller_model_family(name: str) -> str | None:
    """`pruned` or `distilled` when a variant's speed also comes from a smaller model, else None (also for rows
    that are no registered variant)."""
    try:
        family = spec(name).family
    except UnknownVariant:
        return None
    return family if family in ("pruned", "distilled") else None


def speed_verdicts(rows: Results, targets: TargetsParams) -> list[tuple[str, SpeedVerdict]]:
    """The latency verdict over every measured servable INT8 variant (scope `all`) and, when pruned or distilled
    ones are among them, over quantization alone (scope `quantization`), so a smaller model's gain is not read
    as an INT8 one. Empty when no INT8 variant was measured."""
    int8 = {n: e for n, e in rows.items() if servable_int8(n) and e["status"] == "ok"}
    if not int8:
        return []
    out = [("all", speed_verdict(rows, int8, targets))]
    plain = {n: e for n, e in int8.items() if smaller_model_family(n) is None}
    if plain and len(plain) < len(int8):
        out.append(("quantization", speed_verdict(rows, plain, targets)))
    return out


def servable_int8(name: str) -> bool:
    """An INT8 variant served on CPU (`VariantSpec.cpu_int8`), what the package stage chooses among; False for a
    row that is no registered variant."""
    try:
        return spec(name).cpu_int8
    except UnknownVariant:
        return False


#: Two variants scored on the same test reviews are told apart when an exact McNemar test on the reviews only one of
#: them gets right gives p below this; otherwise the test set cannot resolve their accuracy difference (a tie).
TIE_P_VALUE = 0.05


def mcnemar_p(only_first_right: int, only_second_right: int) -> float:
    """Two-sided exact McNemar p-value: how likely a split of the discordant reviews at least this uneven is when
    both variants are equally accurate (each discordant review a fair coin, SciPy's exact binomial test). 1.0 when
    no review differs."""
    from scipy.stats import binomtest

    n = only_first_right + only_second_right
    if n == 0:
        return 1.0
    return float(binomtest(only_first_right, n, 0.5).pvalue)


def int8_candidates(variants: Results, targets: TargetsParams) -> dict[str, Mapping[str, Any]]:
    """The servable INT8 variants, built and scored, within the accuracy budget: what `auto` chooses among."""
    ref = variants[REFERENCE]["accuracy"]
    return {n: e for n, e in variants.items()
            if servable_int8(n) and e.get("status") == "ok" and within_budget(ref, e["accuracy"], targets)}


def most_accurate(candidates: Results) -> str | None:
    """The most accurate candidate (the smaller file on equal accuracy), None when there is none."""
    if not candidates:
        return None
    return max(candidates, key=lambda n: (candidates[n]["accuracy"], -candidates[n]["size_mb"]))


@dataclass(frozen=True)
class ServedChoice:
    """The variant package serves, and why."""

    name: str
    reason: str


def _tie_evidence(name: str, entry: Mapping[str, Any], p50_ms: float) -> str:
    """One tied variant in numbers: its accuracy and batch-1 p50, and the paired test against the most accurate."""
    return (f"{name} {100 * entry['accuracy']:.2f}% at {p50_ms:.2f} ms, {entry['paired_only_reference_right']} + "
            f"{entry['paired_only_this_right']} reviews only one of the two gets right, "
            f"p = {entry['paired_p_value']:.2f}")


def choose_variant(variants: Results, params: PackageParams, targets: TargetsParams,
                   benchmark: Results | None = None) -> ServedChoice:
    """`auto`: among the servable INT8 variants within the accuracy budget, the most accurate
    (`package.prefer: accuracy`) or the fastest at batch 1 in `benchmark` (`prefer: speed`); else the FP32 ONNX
    export. Under `accuracy`, variants the test set cannot tell apart from the most accurate (evaluate's paired
    test on the same reviews, `paired_p_value` >= `TIE_P_VALUE`) are tied with it, and the tie goes to the fastest
    at batch 1: a slower variant is never served for a difference the test set cannot resolve. A variant named in
    `package.variant` must be servable and built (`SelectionError` otherwise)."""
    if params.variant != "auto":
        if params.variant not in {v.name for v in VARIANTS if v.servable}:
            raise SelectionError(f"package.variant={params.variant} is not a variant the handler can serve "
                                 f"({', '.join(v.name for v in VARIANTS if v.servable)})")
        entry = variants.get(params.variant)
        if entry is None or entry.get("status") != "ok":
            raise SelectionError(f"package.variant={params.variant} is not an available variant "
                                 f"({sorted(n for n, e in variants.items() if e.get('status') == 'ok')})")
        return ServedChoice(params.variant, "named in params (package.variant)")
    ref = variants[REFERENCE]["accuracy"]
    budget = targets.max_accuracy_loss_pt
    ok = int8_candidates(variants, targets)
    timed = {n: (benchmark or {}).get(n, {}).get("p50_ms_b1") for n in ok}
    if ok and params.prefer == "speed":
        missing = sorted(n for n, p50 in timed.items() if p50 is None)
        if missing:
            raise SelectionError(f"package.prefer=speed needs batch-1 latencies; none in the benchmark for {missing}")
        best = min(ok, key=lambda n: (timed[n], -ok[n]["accuracy"]))
        return ServedChoice(best, f"fastest INT8 variant within {budget} pt of FP32 (package.prefer: speed): "
                                  f"p50 {timed[best]:.2f} ms, {100 * ok[best]['accuracy']:.2f}% vs {100 * ref:.2f}%")
    best = most_accurate(ok)
    if best is None:
        return ServedChoice("fp32-onnx", f"no INT8 variant within {budget} pt of FP32; serving FP32 ONNX")
    reason = (f"most accurate INT8 variant within {budget} pt of FP32 "
              f"({100 * ok[best]['accuracy']:.2f}% vs {100 * ref:.2f}%)")
    tied = {n for n, e in ok.items() if n != best and e.get("paired_reference") == best
            and e.get("paired_p_value", 0.0) >= TIE_P_VALUE and timed[n] is not None}
    if timed[best] is None or not tied:
        return ServedChoice(best, reason)
    fastest = min(tied | {best}, key=lambda n: (timed[n], -ok[n]["accuracy"]))
    if fastest == best:
        evidence = "; ".join(_tie_evidence(n, ok[n], timed[n]) for n in sorted(tied))
        return ServedChoice(best, f"{reason}, and the fastest at batch 1 ({timed[best]:.2f} ms) of those the test "
                                  f"set cannot tell apart from it (exact McNemar p >= {TIE_P_VALUE}): {evidence}")
    e = ok[fastest]
    return ServedChoice(fastest, (
        f"fastest at batch 1 ({timed[fastest]:.2f} ms vs {timed[best]:.2f} ms) of the INT8 variants within {budget} pt "
        f"of FP32 that the test set cannot tell apart from the most accurate, {best} "
        f"({100 * e['accuracy']:.2f}% vs {100 * ok[best]['accuracy']:.2f}%: on the {e['paired_only_reference_right']} "
        f"+ {e['paired_only_this_right']} reviews only one of them gets right, exact McNemar p = "
        f"{e['paired_p_value']:.2f} >= {TIE_P_VALUE})"))
