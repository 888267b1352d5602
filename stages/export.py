"""DVC stage `export`: finetuned model -> the variants the registry assigns to `export`, parity-checked."""

from __future__ import annotations

from pipeline.core.stage import StageContext, stage_main
from stages.options import Finetuned, Tokenized, VariantsDir


def export(stage: StageContext, finetuned: Finetuned, tokenized: Tokenized, variants_dir: VariantsDir) -> None:
    """Export the finetuned model, inside the stage's MLflow run."""
    from pipeline.core.tracking import tracked_stage
    from pipeline.variants.export import run_export

    tracked_stage(stage.run_context, params=stage.params, stage="export", sections=("export",),
                  body=lambda: run_export(finetuned=finetuned, tokenized=tokenized, variants_root=variants_dir,
                                          params=stage.params.export))


if __name__ == "__main__":
    stage_main("export", export)
