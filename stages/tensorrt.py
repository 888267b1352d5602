"""DVC stage `tensorrt`: TensorRT FP16/INT8 engines where CUDA exists; a recorded skip where it does not."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.tensorrt --finetuned DIR --tokenized DIR --variants-dir DIR`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True, help="calibration and validation reviews")
    parser.add_argument("--variants-dir", type=Path, required=True,
                        help="reads DIR/fp32-onnx and DIR/int8-static, writes DIR/<name>")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.core.tracking import tracked_stage
        from pipeline.variants.tensorrt import run_tensorrt

        params = load_params(args.params)
        tracked_stage(params, "tensorrt", ("tensorrt", "quantize"),
                      lambda: run_tensorrt(args.finetuned, args.variants_dir / "fp32-onnx",
                                           args.variants_dir / "int8-static", args.tokenized, args.variants_dir,
                                           params))

    run_stage("tensorrt", body)


if __name__ == "__main__":
    main()
