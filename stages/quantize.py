"""DVC stage `quantize`: FP32 ONNX -> the INT8 variants the registry assigns to `quantize`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def quantize(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="the tokenized splits (calibration and selection reviews)")],
    variants_dir: Annotated[Path, typer.Option(help="reads DIR/fp32-onnx, writes DIR/<name>")],
) -> None:
    """Build the INT8 variants `quantize.build` lists, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.quantize import run_quantize

    tracked_stage(stage.params, "quantize", ("quantize", "export"),
                  lambda: run_quantize(finetuned, variants_dir / "fp32-onnx", tokenized, variants_dir,
                                       stage.params, stage.auto.weight_format))


def main(argv: list[str] | None = None) -> None:
    stage_main("quantize", quantize, argv)


if __name__ == "__main__":
    main()
