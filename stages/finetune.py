"""DVC stage `finetune`: tokenized IMDB -> best finetuned model (HF format), metrics, curves, MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import Metrics, Plots, Tokenized


def finetune(
    stage: StageContext,
    tokenized: Tokenized,
    model_dir: Annotated[Path, typer.Option(help="where the best model goes (HF format)")],
    metrics: Metrics,
    plots: Plots,
    reports: Annotated[Path, typer.Option(help="confusion matrix and profiler traces")],
    test_predictions: Annotated[Path | None, typer.Option(
        help="where to keep the test logits (the evaluate stage reuses them for FP32)")] = None,
) -> None:
    """Finetune the model; under `train.launcher: torchrun` this process only launches the workers."""
    from pipeline.training import elastic

    params = stage.params
    if params.train.launcher == "torchrun" and not elastic.under_torchelastic():
        # this process only launches: the workers torchrun starts run this stage again, as a group. It imports none
        # of the training code, so it holds no torch in memory (nor spends its import) while the group trains.
        # A group that finished returns (the stage is done); one that failed past its restarts ends with its status.
        if status := elastic.launch(params.train, ["-m", "stages.finetune", *stage.argv]):
            raise SystemExit(status)
        return
    from pipeline.training.finetune import FinetuneOutputs, run_finetune

    outputs = FinetuneOutputs(model_dir=model_dir, metrics_path=metrics, plots_dir=plots, report_dir=reports,
                              predictions_path=test_predictions)
    run_finetune(tokenized_dir=tokenized, outputs=outputs, all_params=params, precision=stage.auto.precision,
                 # rank zero logs for the group: the other ranks never look the parent run up
                 run_context=stage.run_context if elastic.is_rank_zero() else None)


if __name__ == "__main__":
    stage_main("finetune", finetune)
