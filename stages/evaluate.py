"""DVC stage `evaluate`: score every variant on the test split -> metrics/variants.json + MLflow runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Metrics, Tokenized, VariantsDir


def evaluate(
    stage: StageContext,
    finetuned: Finetuned,
    tokenized: Tokenized,
    variants_dir: VariantsDir,
    metrics: Metrics,
    plot: Annotated[Path, typer.Option(help="the accuracy chart")],
    reference_predictions: Annotated[Path | None, typer.Option(
        help="the finetune stage's test logits: the FP32 reference row reuses them")] = None,
) -> None:
    """Score every variant and log each as an MLflow model."""
    from pipeline.evaluation.accuracy import run_evaluate_stage

    run_evaluate_stage(finetuned=finetuned, variants_root=variants_dir, tokenized=tokenized,
                       reference_predictions=reference_predictions, metrics_path=metrics, plot=plot,
                       params=stage.params, run_context=stage.run_context)


if __name__ == "__main__":
    stage_main("evaluate", evaluate)
