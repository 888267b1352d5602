"""DVC stage `export`: finetuned model -> `fp32-torchscript` and `fp32-onnx` variants, parity-checked."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.export --finetuned DIR --tokenized DIR --out NAME=DIR ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--out", action="append", required=True, help="variant=directory")
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage
    from pipeline.variants.export import ExportError
    from pipeline.variants.record import VariantError

    def body() -> None:
        from pipeline.core.params import ExportParams, MlflowParams, read_params, section, to_dict
        from pipeline.core.tracking import log_metrics_flat, log_params_flat, stage_run
        from pipeline.variants.export import run_export

        raw = read_params(args.params)
        params = section(raw, "export", ExportParams)
        with stage_run(section(raw, "mlflow", MlflowParams), "export"):
            log_params_flat({"export": to_dict(params)})
            log_metrics_flat(run_export(args.finetuned, args.tokenized, named_paths(args.out), params))

    run_stage("export", body, extra_errors=(ExportError, VariantError))


if __name__ == "__main__":
    main()
