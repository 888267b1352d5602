"""DVC stage `benchmark`: latency, throughput and memory of every variant -> metrics, plot data, report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Metrics, Tokenized, VariantsDir


def benchmark(
    stage: StageContext,
    finetuned: Finetuned,
    tokenized: Tokenized,
    variants_dir: VariantsDir,
    accuracy: Annotated[Path, typer.Option(help="metrics/variants.json")],
    metrics: Metrics,
    plot_data: Annotated[Path, typer.Option(help="the latency table for `dvc plots`")],
    report: Annotated[Path, typer.Option(help="the markdown report")],
) -> None:
    """Time every variant against FP32 eager."""
    from pipeline.evaluation.benchmark import run_benchmark_stage

    run_benchmark_stage(finetuned=finetuned, variants_root=variants_dir, tokenized=tokenized, accuracy_file=accuracy,
                        metrics_path=metrics, plot_data=plot_data, report=report, all_params=stage.params,
                        bf16=stage.auto.bf16_row, run_context=stage.run_context)


if __name__ == "__main__":
    stage_main("benchmark", benchmark)
