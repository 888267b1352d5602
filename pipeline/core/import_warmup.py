"""The bytecode of the libraries the stages import, written ahead by a background process that `make run` starts.

A fresh venv is installed without bytecode (the Makefile's venv rule: compiling all of its modules at install costs
more than it saves), so each module is compiled by its first import, and the stage that first imports torch,
Lightning, transformers' models or NNCF pays for it on the run's critical path. `make run` starts this module at
the lowest CPU priority beside `dvc repro`: while the prepare stage keeps one core busy, it compiles on the other by
importing what the later stages import (an import is what writes a module's bytecode, into the venv's
`__pycache__`, atomically, so a stage importing the same module meanwhile is safe), and it yields the cores to any
stage that keeps both busy. It changes when the compiling happens, nothing else: a module not listed is compiled by
its stage as before, one that a stage no longer imports costs only this process's time, and one that fails to import
is left to the stage that needs it to report."""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Sequence
from pathlib import Path

#: The third-party modules the stages import (most inside functions, so importing the stages' own modules would not
#: reach them), in the order the stages first need them: finetune, export, quantize, evaluate. The default model's
#: architecture (BERT: all-MiniLM-L6-v2) is the one transformers module named for a model.
MODULES: tuple[str, ...] = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.bert.modeling_bert",
    "lightning.pytorch",
    "lightning.pytorch.callbacks",
    "torchmetrics.classification",
    "mlflow.pyfunc",
    "matplotlib.pyplot",
    "onnx",
    "onnx_ir",
    "onnxscript.optimizer",
    "onnxscript.rewriter.ort_fusions",
    "torch.onnx",
    "onnxruntime",
    "onnxruntime.quantization",
    "onnxruntime.transformers.optimizer",
    "openvino",
    "openvino.frontend.pytorch",
    "nncf",
    "nncf.torch",
    "torchao.quantization.pt2e",
    "sklearn.metrics",
    "scipy.stats",
)


def warm(modules: Sequence[str] = MODULES) -> list[str]:
    """Import each of `modules`, in order; the names that failed to import."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # an optional runtime absent or broken here: the stage that needs it says so, not this
            failed.append(name)
    return failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stamp", type=Path, help="written once every module is imported: `make run` starts no "
                                                   "second warm-up while it exists")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    failed = warm(MODULES)
    if args.stamp is not None:
        args.stamp.write_text(f"{len(MODULES) - len(failed)} of {len(MODULES)} modules imported in "
                              f"{time.perf_counter() - started:.1f} s; not importable: {', '.join(failed) or 'none'}\n")


if __name__ == "__main__":
    main()
