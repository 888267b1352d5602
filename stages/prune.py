"""DVC stage `prune`: finetuned model -> `int8-pruned` (fewer heads and FFN neurons, then dynamic INT8)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def prune(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="the tokenized splits (calibration and parity reviews)")],
    variants_dir: Annotated[Path, typer.Option(help="each variant goes to DIR/<name>")],
) -> None:
    """Prune and quantize the finetuned model, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.prune import run_prune

    tracked_stage(stage.params, "prune", ("prune", "quantize", "export"),
                  lambda: {"int8-pruned": run_prune(finetuned, tokenized, variants_dir, stage.params,
                                                    stage.auto.weight_format)})


def main(argv: list[str] | None = None) -> None:
    stage_main("prune", prune, argv)


if __name__ == "__main__":
    main()
