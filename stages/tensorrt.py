"""DVC stage `tensorrt`: TensorRT FP16/INT8 engines where CUDA exists; a recorded skip where it does not."""

from __future__ import annotations

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Tokenized, VariantsDir


def tensorrt(stage: StageContext, finetuned: Finetuned, tokenized: Tokenized, variants_dir: VariantsDir) -> None:
    """Build the engines (or record the skip), inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.tensorrt import run_tensorrt

    tracked_stage(stage.run_context, params=stage.params, stage="tensorrt", sections=("tensorrt", "quantize"),
                  body=lambda: run_tensorrt(finetuned=finetuned, fp32_onnx=variants_dir / "fp32-onnx",
                                            int8_static=variants_dir / "int8-static", tokenized=tokenized,
                                            variants_root=variants_dir, params=stage.params))


if __name__ == "__main__":
    stage_main("tensorrt", tensorrt)
