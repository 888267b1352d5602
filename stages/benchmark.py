"""DVC stage `benchmark`: latency/throughput/memory of every variant vs FP32 eager, report and MLflow runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.benchmark --finetuned DIR --tokenized DIR --variant NAME=DIR ... --accuracy FILE ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="variant=directory")
    parser.add_argument("--accuracy", type=Path, required=True, help="metrics/variants.json")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plot-data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage
    from pipeline.variants.record import VariantError

    def body() -> None:
        from pipeline.core.params import BenchmarkParams, MlflowParams, read_params, section
        from pipeline.evaluation.benchmark import run_benchmark_stage

        raw = read_params(args.params)
        run_benchmark_stage(args.finetuned, named_paths(args.variant), args.tokenized, args.accuracy, args.metrics,
                            args.plot_data, args.report, section(raw, "benchmark", BenchmarkParams),
                            section(raw, "mlflow", MlflowParams))

    run_stage("benchmark", body, extra_errors=(VariantError,))


if __name__ == "__main__":
    main()
