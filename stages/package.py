"""DVC stage `package`: choose the variant to serve, register it as `@champion`, build `model_store/sentiment.mar`."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.package --variants-metrics FILE --benchmark FILE --variants-dir DIR --mar FILE ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variants-metrics", type=Path, required=True,
                        help="metrics/variants.json (accuracy and each variant's MLflow model id)")
    parser.add_argument("--benchmark", type=Path, required=True,
                        help="metrics/benchmark.json (the served variant's latency for the run summary)")
    parser.add_argument("--variants-dir", type=Path, required=True, help="every registered variant under DIR/<name>")
    parser.add_argument("--mar", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.deployment.archive import run_package_stage

        run_package_stage(args.variants_dir, args.variants_metrics, args.benchmark, args.mar, args.manifest,
                          load_params(args.params))

    run_stage("package", body)


if __name__ == "__main__":
    main()
