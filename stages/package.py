"""DVC stage `package`: choose the variant to serve, register it as `@champion`, build `model_store/sentiment.mar`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.stage import StageContext, stage_main
from stages.options import VariantsDir


def package(
    stage: StageContext,
    variants_metrics: Annotated[Path, typer.Option(
        help="metrics/variants.json (accuracy and each variant's MLflow model id)")],
    benchmark: Annotated[Path, typer.Option(
        help="metrics/benchmark.json (the served variant's latency for the run summary)")],
    variants_dir: VariantsDir,
    mar: Annotated[Path, typer.Option(help="the TorchServe archive to write")],
    manifest: Annotated[Path, typer.Option(help="metrics/package.json")],
) -> None:
    """Choose, register and archive the served variant."""
    from pipeline.deployment.archive import run_package_stage

    run_package_stage(variants_root=variants_dir, variants_metrics=variants_metrics, benchmark_metrics=benchmark,
                      mar=mar, manifest_path=manifest, params=stage.params, run_context=stage.run_context)


if __name__ == "__main__":
    stage_main("package", package)
