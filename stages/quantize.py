"""DVC stage `quantize`: FP32 ONNX -> the INT8 variants the registry assigns to `quantize`."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.quantize --finetuned DIR --tokenized DIR --variants-dir DIR`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variants-dir", type=Path, required=True, help="reads DIR/fp32-onnx, writes DIR/<name>")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.core.tracking import tracked_stage
        from pipeline.variants.quantize import run_quantize

        params = load_params(args.params)
        tracked_stage(params, "quantize", ("quantize", "export"),
                      lambda: run_quantize(args.finetuned, args.variants_dir / "fp32-onnx", args.tokenized,
                                           args.variants_dir, params))

    run_stage("quantize", body)


if __name__ == "__main__":
    main()
