"""DVC stage `benchmark`: latency, throughput and memory of every variant -> metrics, plot data, report."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.benchmark --finetuned DIR --tokenized DIR --variants-dir DIR --accuracy FILE ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variants-dir", type=Path, required=True, help="every registered variant under DIR/<name>")
    parser.add_argument("--accuracy", type=Path, required=True, help="metrics/variants.json")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--plot-data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.evaluation.benchmark import run_benchmark_stage

        run_benchmark_stage(args.finetuned, args.variants_dir, args.tokenized, args.accuracy, args.metrics,
                            args.plot_data, args.report, load_params(args.params))

    run_stage("benchmark", body)


if __name__ == "__main__":
    main()
