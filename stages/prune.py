"""DVC stage `prune`: finetuned model -> `int8-pruned` (fewer heads and FFN neurons, then dynamic INT8)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.prune --finetuned DIR --tokenized DIR --out DIR`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the int8-pruned variant directory")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage
    from pipeline.variants.export import ExportError
    from pipeline.variants.onnx_int8 import QuantizeError
    from pipeline.variants.prune import PruneError
    from pipeline.variants.record import VariantError

    def body() -> None:
        from pipeline.core.params import (
            ExportParams,
            MlflowParams,
            PruneParams,
            QuantizeParams,
            TrainParams,
            read_params,
            section,
            to_dict,
        )
        from pipeline.core.tracking import log_metrics_flat, log_params_flat, stage_run
        from pipeline.variants.prune import run_prune

        raw = read_params(args.params)
        params = section(raw, "prune", PruneParams)
        quantize = section(raw, "quantize", QuantizeParams)
        seed = section(raw, "train", TrainParams).seed
        readout = section(raw, "export", ExportParams).cls_readout
        with stage_run(section(raw, "mlflow", MlflowParams), "prune"):
            log_params_flat({"prune": to_dict(params), "quantize": {"per_channel": quantize.per_channel,
                                                                     "reduce_range": quantize.reduce_range},
                             "export": {"cls_readout": readout}})
            report = run_prune(args.finetuned, args.tokenized, args.out, params, quantize, seed, readout)
            log_metrics_flat({"int8-pruned": report})

    run_stage("prune", body, extra_errors=(PruneError, QuantizeError, VariantError, ExportError))


if __name__ == "__main__":
    main()
