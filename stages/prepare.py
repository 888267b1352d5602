"""DVC stage `prepare`: IMDB -> cleaned, split, validated and tokenized parquet files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def prepare(
    stage: StageContext,
    prepared: Annotated[Path, typer.Option(help="where the cleaned splits go")],
    tokenized: Annotated[Path, typer.Option(help="where the tokenized splits go")],
    metrics: Annotated[Path, typer.Option(help="metrics/prepare.json")],
) -> None:
    """Read, clean, split, validate and tokenize IMDB."""
    from pipeline.data.prepare import run_prepare_stage
    from pipeline.modeling import load_tokenizer

    run_prepare_stage(stage.params, load_tokenizer(stage.params.model), prepared, tokenized, metrics)


def main(argv: list[str] | None = None) -> None:
    stage_main("prepare", prepare, argv)


if __name__ == "__main__":
    main()
