"""DVC stage `evaluate`: score every variant on the test split -> metrics/variants.json + MLflow runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.evaluate --finetuned DIR --tokenized DIR --variants-dir DIR --metrics FILE --plot FILE`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variants-dir", type=Path, required=True, help="every registered variant under DIR/<name>")
    parser.add_argument("--reference-predictions", type=Path, default=None,
                        help="the finetune stage's test logits: the FP32 reference row reuses them")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.evaluation.accuracy import run_evaluate_stage

        run_evaluate_stage(args.finetuned, args.variants_dir, args.tokenized, args.reference_predictions,
                           args.metrics, args.plot, load_params(args.params))

    run_stage("evaluate", body)


if __name__ == "__main__":
    main()
