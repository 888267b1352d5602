"""DVC stage `distill`: finetuned teacher -> a smaller student (HF format, metrics, curves, MLflow) and the
variants the registry assigns to `distill` (its FP32 ONNX export and dynamic INT8)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import Metrics, Plots, Tokenized, VariantsDir


def distill(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the teacher (HF format)")],
    tokenized: Tokenized,
    student_dir: Annotated[Path, typer.Option(help="where the student goes (HF format)")],
    metrics: Metrics,
    plots: Plots,
    variants_dir: VariantsDir,
) -> None:
    """Distill the student (or record why not), then build its variants in the same MLflow run; under multi-process
    DDP, a process of rank > 0 (Lightning runs this stage again for each) only trains its share."""
    from pipeline.training.distill import run_distill
    from pipeline.training.elastic import is_rank_zero
    from pipeline.variants.distilled import run_distilled_variants

    params, auto = stage.params, stage.auto
    run_distill(teacher_dir=finetuned, tokenized_dir=tokenized, student_dir=student_dir, metrics_path=metrics,
                plots_dir=plots, params=params, auto=auto,
                # rank zero logs for the group: the other ranks never look the parent run up
                run_context=stage.run_context if is_rank_zero() else None,
                build_variants=lambda: run_distilled_variants(student_dir=student_dir, tokenized=tokenized,
                                                              variants_root=variants_dir, params=params,
                                                              weight_format=auto.weight_format))


if __name__ == "__main__":
    stage_main("distill", distill)
