"""Peak memory of one variant in a process of its own, which `pipeline.evaluation.latency.peak_rss_mb` starts:
`python -m pipeline.evaluation.memory_probe DIR --batch-file F --threads N --options JSON` loads the variant in
DIR, answers the batch in F and prints its peak RSS (VmHWM) in MB.

It imports numpy and the runtime registry and nothing of the benchmark stage (its params schema, report templates
and charts), so the figure is what loading and running the variant costs: a process that serves it needs the same."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def vm_hwm_mb() -> float:
    """This process's peak RSS (VmHWM) in MB; unlike ru_maxrss it starts afresh at exec, not at fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the variant (or finetuned model) directory")
    parser.add_argument("--batch-file", type=Path, required=True, help=".npz with `ids` and `mask`")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--options", default="{}", help="the runner's options, as JSON")
    args = parser.parse_args(argv)

    import numpy as np

    from pipeline.runtimes.registry import load_runner

    data = np.load(args.batch_file)
    runner = load_runner(args.directory, args.threads, **json.loads(args.options))
    runner(data["ids"], data["mask"])
    print(vm_hwm_mb())


if __name__ == "__main__":
    from pipeline.core.process_exit import skip_final_collection

    skip_final_collection()
    main()
