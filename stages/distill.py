"""DVC stage `distill`: finetuned teacher -> a smaller student (HF format, metrics, curves, MLflow) and the
variants the registry assigns to `distill` (its FP32 ONNX export and dynamic INT8)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.distill --finetuned DIR --tokenized DIR --student-dir DIR --variants-dir DIR ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True, help="the teacher")
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--student-dir", type=Path, required=True)
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plots", type=Path, required=True)
    parser.add_argument("--variants-dir", type=Path, required=True, help="each variant goes to DIR/<name>")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.training.distill import run_distill
        from pipeline.variants.distilled import run_distilled_variants

        params = load_params(args.params)
        run_distill(args.finetuned, args.tokenized, args.student_dir, args.metrics, args.plots, params,
                    lambda: run_distilled_variants(args.student_dir, args.tokenized, args.variants_dir, params))

    run_stage("distill", body)


if __name__ == "__main__":
    main()
