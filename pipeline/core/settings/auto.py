"""Every `auto` setting resolved once, for one machine, into a frozen record a stage passes down and records.

`auto` settings and what decides them (`pipeline.core.machine` holds each rule and its reason):
`train.precision` (CUDA and bf16 support, or the CPU's native bf16), `quantize.qat_precision` (the CPU's native
bf16), `distill.enabled` (whether training is
accelerated, given the resolved precision), `quantize.weight_format` (the CPU's INT8 dot products) and
`benchmark.bf16_row` (the CPU's native bf16). `train.accelerator`/`train.strategy: auto` are Lightning's own and
pass through; `package.variant: auto` is decided from evaluation results, not the machine (package stage)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeline.core.machine import (
    Choice,
    resolve_bf16_row,
    resolve_distill,
    resolve_precision,
    resolve_qat_precision,
    resolve_weight_format,
)
from pipeline.core.settings.root import Params


@dataclass(frozen=True)
class ResolvedAuto:
    """What each `auto` setting became on this machine, and why (`Choice.reason`)."""

    precision: Choice
    distill: Choice
    weight_format: Choice
    bf16_row: Choice
    qat_precision: Choice

    def choices(self) -> dict[str, dict[str, Any]]:
        """Setting -> its choice as a dict (for metrics files and MLflow params)."""
        return {c.setting: c.to_dict() for c in (self.precision, self.distill, self.weight_format, self.bf16_row,
                                                   self.qat_precision)}

    def apply(self, params: Params) -> Params:
        """`params` with each `auto` replaced by its resolved value (validated like any other params)."""
        return dataclasses.replace(
            params,
            train=dataclasses.replace(params.train, precision=self.precision.value),
            distill=dataclasses.replace(params.distill, enabled=bool(self.distill.value)),
            quantize=dataclasses.replace(params.quantize, weight_format=self.weight_format.value,
                                         qat_precision=self.qat_precision.value),
            benchmark=dataclasses.replace(params.benchmark, bf16_row=bool(self.bf16_row.value)),
        )


def resolve_auto(params: Params, flags: frozenset[str] | None = None, cuda: bool | None = None) -> ResolvedAuto:
    """Every `auto` of `params` resolved for the machine described by `flags` (CPU ISA flags; default: this CPU's, or
    `$PIPELINE_CPU_FLAGS`) and `cuda` (whether a CUDA device is visible; default: ask torch)."""
    train = params.train
    precision = resolve_precision(train.precision, train.accelerator, flags, cuda)
    return ResolvedAuto(
        precision=precision,
        distill=resolve_distill(params.distill.enabled, train.accelerator, precision.value, cuda),
        weight_format=resolve_weight_format(params.quantize.weight_format, flags),
        bf16_row=resolve_bf16_row(params.benchmark.bf16_row, flags),
        qat_precision=resolve_qat_precision(params.quantize.qat_precision, flags),
    )
