"""DVC stage `quantize`: FP32 ONNX -> the INT8 variants the registry assigns to `quantize`."""

from __future__ import annotations

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Tokenized, VariantsDir


def quantize(stage: StageContext, finetuned: Finetuned, tokenized: Tokenized, variants_dir: VariantsDir) -> None:
    """Build the INT8 variants `quantize.build` lists, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.quantize import run_quantize

    tracked_stage(stage.run_context, params=stage.params, stage="quantize", sections=("quantize", "export"),
                  body=lambda: run_quantize(finetuned=finetuned, fp32_onnx=variants_dir / "fp32-onnx",
                                            tokenized=tokenized, variants_root=variants_dir, params=stage.params,
                                            choice=stage.auto.weight_format,
                                            qat_precision=stage.auto.qat_precision))


if __name__ == "__main__":
    stage_main("quantize", quantize)
