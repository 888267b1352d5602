"""DVC stage `prepare`: IMDB -> cleaned, split, validated and tokenized parquet files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import Metrics, Tokenized


def prepare(
    stage: StageContext,
    prepared: Annotated[Path, typer.Option(help="where the cleaned splits go")],
    tokenized: Tokenized,
    metrics: Metrics,
) -> None:
    """Read, clean, split, validate and tokenize IMDB."""
    from pipeline.data.prepare import run_prepare_stage
    from pipeline.modeling import load_tokenizer

    run_prepare_stage(params=stage.params, tokenizer=load_tokenizer(stage.params.model), prepared_dir=prepared,
                      tokenized_dir=tokenized, metrics_path=metrics, run_context=stage.run_context)


if __name__ == "__main__":
    stage_main("prepare", prepare)
