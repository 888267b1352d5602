"""DVC stage `finetune`: tokenized IMDB -> best finetuned model (HF format), metrics, curves, MLflow."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.finetune --params params.yaml --tokenized DIR --model-dir DIR --metrics FILE ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plots", type=Path, required=True)
    parser.add_argument("--reports", type=Path, required=True)
    parser.add_argument("--test-predictions", type=Path, default=None,
                        help="where to keep the test logits (the evaluate stage reuses them for FP32)")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.training import elastic
        from pipeline.training.finetune import run_finetune

        params = load_params(args.params)
        if params.train.launcher == "torchrun" and not elastic.under_torchelastic():
            # this process only launches: the workers torchrun starts run this stage again, as a group
            program = ["-m", "stages.finetune", *(sys.argv[1:] if argv is None else argv)]
            raise SystemExit(elastic.launch(params.train, program))
        run_finetune(
            tokenized_dir=args.tokenized, model_dir=args.model_dir, metrics_path=args.metrics,
            plots_dir=args.plots, report_dir=args.reports, predictions_path=args.test_predictions,
            data=params.data, model=params.model, train=params.train, tracking=params.mlflow,
        )

    run_stage("finetune", body)


if __name__ == "__main__":
    main()
