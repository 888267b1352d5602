"""DVC stage `benchmark`: latency, throughput and memory of every variant -> metrics, plot data, report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def benchmark(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="the tokenized splits (the test reviews are timed)")],
    variants_dir: Annotated[Path, typer.Option(help="every registered variant under DIR/<name>")],
    accuracy: Annotated[Path, typer.Option(help="metrics/variants.json")],
    metrics: Annotated[Path, typer.Option(help="metrics/benchmark.json")],
    plot_data: Annotated[Path, typer.Option(help="the latency table for `dvc plots`")],
    report: Annotated[Path, typer.Option(help="the markdown report")],
) -> None:
    """Time every variant against FP32 eager."""
    from pipeline.evaluation.benchmark import run_benchmark_stage

    run_benchmark_stage(finetuned, variants_dir, tokenized, accuracy, metrics, plot_data, report, stage.params,
                        stage.auto.bf16_row)


def main(argv: list[str] | None = None) -> None:
    stage_main("benchmark", benchmark, argv)


if __name__ == "__main__":
    main()
