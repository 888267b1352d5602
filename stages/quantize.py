"""DVC stage `quantize`: FP32 ONNX -> `int8-dynamic`, `int8-static` and `int8-qat` variants."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.quantize --finetuned DIR --fp32-onnx DIR --tokenized DIR --out NAME=DIR ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--fp32-onnx", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--out", action="append", required=True, help="variant=directory")
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage
    from pipeline.variants.export import ExportError
    from pipeline.variants.onnx_int8 import QuantizeError
    from pipeline.variants.record import VariantError

    def body() -> None:
        from pipeline.core.params import MlflowParams, QuantizeParams, TrainParams, read_params, section, to_dict
        from pipeline.core.tracking import log_metrics_flat, log_params_flat, stage_run
        from pipeline.variants.quantize import run_quantize

        raw = read_params(args.params)
        params = section(raw, "quantize", QuantizeParams)
        seed = section(raw, "train", TrainParams).seed
        with stage_run(section(raw, "mlflow", MlflowParams), "quantize"):
            log_params_flat({"quantize": to_dict(params)})
            report = run_quantize(args.finetuned, args.fp32_onnx, args.tokenized, named_paths(args.out), params, seed)
            log_metrics_flat(report)

    run_stage("quantize", body, extra_errors=(QuantizeError, VariantError, ExportError))


if __name__ == "__main__":
    main()
