"""DVC stage `package`: choose the variant to serve and build `model_store/sentiment.mar`."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.package --finetuned DIR --variants-metrics FILE --variant NAME=DIR ... --mar FILE`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--variants-metrics", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="variant=directory")
    parser.add_argument("--mar", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage
    from pipeline.deployment.archive import PackageError

    def body() -> None:
        import mlflow

        from pipeline.core.io import read_json, write_json
        from pipeline.core.params import MlflowParams, PackageParams, read_params, section, to_dict
        from pipeline.core.tracking import log_params_flat, stage_run
        from pipeline.deployment.archive import build_archive, choose_variant, registry_label

        raw = read_params(args.params)
        params, tracking = section(raw, "package", PackageParams), section(raw, "mlflow", MlflowParams)
        dirs = named_paths(args.variant)
        choice = choose_variant(read_json(args.variants_metrics), params)
        if choice.name not in dirs:
            raise PackageError(f"variant {choice.name} chosen but not passed with --variant")
        registry = registry_label(args.finetuned)
        with stage_run(tracking, "package"):
            log_params_flat({"package": to_dict(params)})
            config = build_archive(dirs[choice.name], choice, registry, params, args.mar)
            manifest = {**config, "mar": str(args.mar), "mar_size_mb": round(args.mar.stat().st_size / 1e6, 3)}
            write_json(args.manifest, manifest)
            mlflow.set_tags({"served_variant": choice.name, "served_model": config["model"],
                             "choice_reason": choice.reason, "registered_model_name": registry["name"],
                             "registered_model_version": str(registry["version"]),
                             "registered_model_link": f"models:/{registry['name']}/{registry['version']}"})
            mlflow.log_metric("mar_size_mb", manifest["mar_size_mb"])
            mlflow.log_artifact(str(args.manifest))

    run_stage("package", body, extra_errors=(PackageError,))


if __name__ == "__main__":
    main()
