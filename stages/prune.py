"""DVC stage `prune`: finetuned model -> `int8-pruned` (fewer heads and FFN neurons, then dynamic INT8)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.prune --finetuned DIR --tokenized DIR --variants-dir DIR`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--finetuned", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--variants-dir", type=Path, required=True, help="each variant goes to DIR/<name>")
    args = parser.parse_args(argv)

    from pipeline.core.stage import run_stage

    def body() -> None:
        from pipeline.core.params import load_params
        from pipeline.core.tracking import tracked_stage
        from pipeline.variants.prune import run_prune

        params = load_params(args.params)
        tracked_stage(params, "prune", ("prune", "quantize", "export"),
                      lambda: {"int8-pruned": run_prune(args.finetuned, args.tokenized, args.variants_dir, params)})

    run_stage("prune", body)


if __name__ == "__main__":
    main()
