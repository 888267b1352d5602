"""DVC stage `export`: finetuned model -> the variants the registry assigns to `export`, parity-checked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def export(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="the tokenized splits (parity reviews)")],
    variants_dir: Annotated[Path, typer.Option(help="each variant goes to DIR/<name>")],
) -> None:
    """Export the finetuned model, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.export import run_export

    tracked_stage(stage.params, "export", ("export",),
                  lambda: run_export(finetuned, tokenized, variants_dir, stage.params.export))


def main(argv: list[str] | None = None) -> None:
    stage_main("export", export, argv)


if __name__ == "__main__":
    main()
