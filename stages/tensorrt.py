"""DVC stage `tensorrt`: TensorRT FP16/INT8 engines where CUDA exists; a recorded skip where it does not."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.tensorrt --finetuned DIR --fp32-onnx DIR --int8-static DIR --out NAME=DIR ...`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--fp32-onnx", type=Path, required=True)
    parser.add_argument("--int8-static", type=Path, required=True)
    parser.add_argument("--out", action="append", required=True, help="variant=directory")
    args = parser.parse_args(argv)

    from pipeline.core.stage import named_paths, run_stage

    def body() -> None:
        import mlflow

        from pipeline.core.params import DataParams, MlflowParams, TensorRTParams, read_params, section, to_dict
        from pipeline.core.tracking import log_params_flat, stage_run
        from pipeline.variants.tensorrt import run_tensorrt

        raw = read_params(args.params)
        params = section(raw, "tensorrt", TensorRTParams)
        max_seq = section(raw, "data", DataParams).max_length
        with stage_run(section(raw, "mlflow", MlflowParams), "tensorrt"):
            log_params_flat({"tensorrt": to_dict(params)})
            report = run_tensorrt(args.finetuned, args.fp32_onnx, args.int8_static, named_paths(args.out),
                                  params, max_seq)
            for name, entry in report.items():
                mlflow.set_tag(f"{name}.status", entry["status"])
                if entry.get("reason"):
                    mlflow.set_tag(f"{name}.reason", entry["reason"])

    run_stage("tensorrt", body)


if __name__ == "__main__":
    main()
