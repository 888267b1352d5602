"""DVC stage `export`: finetuned model -> the variants the registry assigns to `export`, parity-checked."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.export --finetuned DIR --tokenized DIR --variants-dir DIR`."""
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
        from pipeline.variants.export import run_export

        params = load_params(args.params)
        tracked_stage(params, "export", ("export",),
                      lambda: run_export(args.finetuned, args.tokenized, args.variants_dir, params.export))

    run_stage("export", body)


if __name__ == "__main__":
    main()
