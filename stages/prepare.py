"""DVC stage `prepare`: IMDB -> cleaned, split, validated and tokenized parquet files."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.prepare --params params.yaml --prepared DIR --tokenized DIR --metrics FILE`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--prepared", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--metrics", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.data.prepare import run_prepare_stage
        from pipeline.modeling import load_tokenizer

        params = load_params(args.params)
        run_prepare_stage(params, load_tokenizer(params.model), args.prepared, args.tokenized, args.metrics)

    run_stage("prepare", body)


if __name__ == "__main__":
    main()
