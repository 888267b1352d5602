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
        import mlflow

        from pipeline.core.params import DataParams, MlflowParams, ModelParams, read_params, section, to_dict
        from pipeline.core.tracking import log_metrics_flat, log_params_flat, stage_run
        from pipeline.data.prepare import prepare

        raw = read_params(args.params)
        data, model = section(raw, "data", DataParams), section(raw, "model", ModelParams)
        tracking = section(raw, "mlflow", MlflowParams)
        with stage_run(tracking, "prepare"):
            log_params_flat({"data": to_dict(data), "model": to_dict(model)})
            metrics = prepare(data, model, args.prepared, args.tokenized, args.metrics)
            log_metrics_flat(metrics)
            mlflow.log_artifact(str(args.metrics))

    run_stage("prepare", body)


if __name__ == "__main__":
    main()
