"""DVC stage `tensorrt`: TensorRT FP16/INT8 engines where CUDA exists; a recorded skip where it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main


def tensorrt(
    stage: StageContext,
    finetuned: Annotated[Path, typer.Option(help="the finetuned model (HF format)")],
    tokenized: Annotated[Path, typer.Option(help="calibration and validation reviews")],
    variants_dir: Annotated[Path, typer.Option(help="reads DIR/fp32-onnx and DIR/int8-static, writes DIR/<name>")],
) -> None:
    """Build the engines (or record the skip), inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.tensorrt import run_tensorrt

    tracked_stage(stage.params, "tensorrt", ("tensorrt", "quantize"),
                  lambda: run_tensorrt(finetuned, variants_dir / "fp32-onnx", variants_dir / "int8-static",
                                       tokenized, variants_dir, stage.params))


def main(argv: list[str] | None = None) -> None:
    stage_main("tensorrt", tensorrt, argv)


if __name__ == "__main__":
    main()
