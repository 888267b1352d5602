"""DVC stage `prune`: finetuned model -> `int8-pruned` (fewer heads and FFN neurons, then dynamic INT8)."""

from __future__ import annotations

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Tokenized, VariantsDir


def prune(stage: StageContext, finetuned: Finetuned, tokenized: Tokenized, variants_dir: VariantsDir) -> None:
    """Prune and quantize the finetuned model, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.prune import run_prune

    tracked_stage(stage.run_context, params=stage.params, stage="prune", sections=("prune", "quantize", "export"),
                  body=lambda: {"int8-pruned": run_prune(finetuned=finetuned, tokenized=tokenized,
                                                         variants_root=variants_dir, all_params=stage.params,
                                                         weight_format=stage.auto.weight_format)})


if __name__ == "__main__":
    stage_main("prune", prune)
