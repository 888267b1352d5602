"""DVC stage `evaluate`: score every variant on the test split -> metrics/variants.json + MLflow runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.evaluate --finetuned DIR --tokenized DIR --variant NAME=DIR ... --metrics FILE`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="variant=directory")
    parser.add_argument("--reference-predictions", type=Path, default=None,
                        help="the finetune stage's test logits: the FP32 reference row reuses them")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage
    from pipeline.variants.record import VariantError

    def body() -> None:
        import logging

        from pipeline.core.io import write_json
        from pipeline.core.params import EvaluateParams, MlflowParams, read_params, section
        from pipeline.core.tracking import log_parent_artifact
        from pipeline.evaluation.accuracy import accuracy_bars, check_targets, log_variant_runs, score_variants

        raw = read_params(args.params)
        params, tracking = section(raw, "evaluate", EvaluateParams), section(raw, "mlflow", MlflowParams)
        variants = named_paths(args.variant)
        results = score_variants(args.finetuned, variants, args.tokenized, params, args.reference_predictions)
        write_json(args.metrics, results)
        accuracy_bars(results, args.plot)
        for line in check_targets(results):
            logging.getLogger("evaluate").info(line)
        log_variant_runs(results, variants, args.finetuned, params, tracking)
        log_parent_artifact(tracking, args.metrics)
        log_parent_artifact(tracking, args.plot)

    run_stage("evaluate", body, extra_errors=(VariantError,))


if __name__ == "__main__":
    main()
