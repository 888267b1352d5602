"""DVC stage `evaluate`: score every variant on the test split -> metrics/variants.json + MLflow runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def evaluate(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="the tokenized splits (the test split is scored)")],
    variants_dir: Annotated[Path, typer.Option(help="every registered variant under DIR/<name>")],
    metrics: Annotated[Path, typer.Option(help="metrics/variants.json")],
    plot: Annotated[Path, typer.Option(help="the accuracy chart")],
    reference_predictions: Annotated[Path | None, typer.Option(
        help="the finetune stage's test logits: the FP32 reference row reuses them")] = None,
) -> None:
    """Score every variant and log each as an MLflow model."""
    from pipeline.evaluation.accuracy import run_evaluate_stage

    run_evaluate_stage(finetuned, variants_dir, tokenized, reference_predictions, metrics, plot, stage.params)


def main(argv: list[str] | None = None) -> None:
    stage_main("evaluate", evaluate, argv)


if __name__ == "__main__":
    main()
