"""The root of the settings: `Params`, one field per `params.yaml` section, the rules that span sections, and the
JSON schema published for editors (`docs/params.schema.json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import TypeAdapter, ValidationInfo, model_validator

from pipeline.core.settings.builders import ExportParams, PruneParams, QuantizeParams, TensorRTParams
from pipeline.core.settings.reporting import (
    BenchmarkParams,
    EvaluateParams,
    MlflowParams,
    PackageParams,
    TargetsParams,
)
from pipeline.core.settings.training import DataParams, DistillParams, ModelParams, TrainParams
from pipeline.core.settings.validation import WHOLE_FILE, settings_section


def _section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls)


@settings_section("")
class Params:
    """Every setting of the pipeline: one section per field. Its defaults are the default profile (`params.yaml`
    holds the same values so that DVC tracks them); a profile in `profiles/` overrides some keys."""

    data: DataParams = _section(DataParams)
    model: ModelParams = _section(ModelParams)
    train: TrainParams = _section(TrainParams)
    distill: DistillParams = _section(DistillParams)
    mlflow: MlflowParams = _section(MlflowParams)
    export: ExportParams = _section(ExportParams)
    quantize: QuantizeParams = _section(QuantizeParams)
    prune: PruneParams = _section(PruneParams)
    tensorrt: TensorRTParams = _section(TensorRTParams)
    evaluate: EvaluateParams = _section(EvaluateParams)
    benchmark: BenchmarkParams = _section(BenchmarkParams)
    targets: TargetsParams = _section(TargetsParams)
    package: PackageParams = _section(PackageParams)

    @model_validator(mode="after")
    def _sections_agree(self, info: ValidationInfo) -> Params:
        """Rules across sections, checked for whole params files (`validate`); a `Params` assembled in code from
        a few sections (tests, benchmarks) is not held to them."""
        if not (info.context or {}).get(WHOLE_FILE):
            return self
        longest = self.data.max_length
        problems = [f"{key}: must be at most data.max_length ({longest}), got {value}" for key, value in (
            ("train.max_length", self.train.max_length),
            ("tensorrt.min_seq", self.tensorrt.min_seq),
            # the batch-1 latency reads reviews of exactly this many tokens, and prepare cut them to data.max_length
            ("benchmark.seq_len", self.benchmark.seq_len),
        ) if value is not None and value > longest]
        if problems:
            raise ValueError("; ".join(problems))
        return self


#: Section name -> its class, in file order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Params)}  # type: ignore[misc]


def json_schema() -> dict[str, Any]:
    """The JSON schema of a params file (profiles are partial: editors check their keys and values with it too)."""
    schema = TypeAdapter(Params).json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema,
            "title": "sentiment-pipeline params.yaml and profiles"}
