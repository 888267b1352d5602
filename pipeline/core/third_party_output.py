"""What third-party libraries print that a stage process does not show, each with the reason: log lines (logger
levels and filters) and warnings (`THIRD_PARTY_WARNINGS`, which tests/conftest.py gives pytest too, so the tests
and the stages hide the same ones). Each is a library's note on its own code, or on a configuration the pipeline
chose on purpose, with nothing for the pipeline to change; everything else those libraries say is shown."""

from __future__ import annotations

import builtins
import logging
import os
import re
import warnings

#: Third-party warnings left unshown, as `python -W` and pytest's `filterwarnings` write them
#: (`action:message regex:category:module regex`).
THIRD_PARTY_WARNINGS: tuple[str, ...] = (
    # torch's pytree deprecates its `LeafSpec` while torch's own export code deep-copies them (the warning is raised
    # in copyreg: the ONNX export, OpenVINO's conversion of an ExportedProgram) and Lightning's helper tests for it
    "ignore:.*LeafSpec.*:FutureWarning:copyreg",
    "ignore:.*LeafSpec.*::lightning\\.pytorch\\.utilities\\._pytree",
    # the ONNX exporter's note that both inputs name the same batch and sequence dims, which they share by design
    "ignore:.*The axis name.*:UserWarning:torch\\.onnx",
    # QAT trains without validation (it keeps its last weights) a module that defines a validation step
    "ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning:lightning",
    # Lightning's model summary counts bf16-mixed weights at 32 bits; the stages record sizes themselves
    "ignore:Precision .* is not supported by the model summary:UserWarning:lightning",
)


#: Third-party log lines left unshown, as (logger, message regex, a part of the logging file's path or ""); the
#: logger "" stands for the root logger's handlers, where a library logs through the root logger.
THIRD_PARTY_LINES: tuple[tuple[str, str, str], ...] = (
    # onnxruntime's advice to run its quantization pre-processing (`quant_pre_process`: shape inference and graph
    # optimization), printed by every quantizer call on a graph without the metadata that step writes. The quantize
    # stage has done what it asks or chosen not to (`pipeline.variants.onnx_int8`): by default it quantizes
    # onnxruntime's own fused graph (`quantize.optimize_graph`), whose contrib ops that step cannot type
    # (`typed_contrib_outputs` types them); the static quantizer's unfused input goes through that step; and an
    # unfused graph that dynamic quantization reads is unfused because the params ask for it.
    ("", "pre-processing before quantization", f"{os.sep}onnxruntime{os.sep}quantization{os.sep}"),
    # PyTorch's notice that registering an Enum as a pytree constant is deprecated, which torchao's import
    # (transformers imports torchao in every process that loads a model) prints for two of its own Enums
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported", ""),
    # the ONNX exporter's line for each torchvision operator it does not register (the models use none)
    ("torch.onnx._internal.exporter._registration", "^torchvision is not installed", ""),
)
#: Lightning's advertisement for its hosted logger, printed by every Trainer that has another logger
#: (`lightning_lines_once` drops it once Lightning is imported).
LITLOGGER_TIP = ("lightning.pytorch.utilities.rank_zero", "(?i)litlogger", "")


def quiet_third_party_warnings(specs: tuple[str, ...] = THIRD_PARTY_WARNINGS) -> None:
    """Install `specs` (the `-W` form) in this process's warning filters, ahead of those already there."""
    for spec in specs:
        action, message, category, module = spec.split(":", 3)
        warnings.filterwarnings(action, message=message,  # type: ignore[arg-type]
                                category=getattr(builtins, category) if category else Warning, module=module)


def quiet_third_party_output() -> None:
    """The logger levels, filters and warning filters below, in a stage process whose root logger has its handler."""
    for noisy in ("urllib3", "alembic", "httpx", "filelock", "onnx_ir", "onnxscript"):  # per-node rewrite lines
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("torchao").setLevel(logging.ERROR)  # "skipping its C++ kernels": see the Makefile
    root_handlers = logging.getLogger().handlers
    for handler in root_handlers:
        if not any(isinstance(f, QuietThirdPartyRootInfo) for f in handler.filters):
            handler.addFilter(QuietThirdPartyRootInfo())
    for logger, pattern, path in THIRD_PARTY_LINES:
        for target in root_handlers if logger == "" else [logging.getLogger(logger)]:
            drop_once(target, DroppedLine(pattern, path))
    quiet_third_party_warnings()


class DroppedLine(logging.Filter):
    """Drops the records whose message matches `pattern` (anywhere, `re.search`) and, where `path` is given, whose
    logging file's path holds it; every other record passes."""

    def __init__(self, pattern: str, path: str = "") -> None:
        super().__init__()
        self.pattern, self.path = re.compile(pattern), path

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.path in record.pathname and self.pattern.search(record.getMessage()))


def drop_once(target: logging.Filterer, dropped: DroppedLine) -> None:
    """`dropped` on `target` (a logger or a handler), unless a filter dropping the same lines is there already."""
    key = (dropped.pattern.pattern, dropped.path)
    if not any(isinstance(f, DroppedLine) and (f.pattern.pattern, f.path) == key for f in target.filters):
        target.addFilter(dropped)


class QuietThirdPartyRootInfo(logging.Filter):
    """Drops INFO/DEBUG lines that a library sends through the *root* logger (`logging.info(...)`).

    onnxruntime's quantizer does this (~40 per-tensor lines per build); a named logger could simply be
    set to WARNING, the root one cannot without hiding our own INFO lines.
    """

    def __init__(self, packages: tuple[str, ...] = ("onnxruntime",)) -> None:
        super().__init__()
        self.packages = packages

    def filter(self, record: logging.LogRecord) -> bool:
        from_package = any(f"{os.sep}{p}{os.sep}" in record.pathname for p in self.packages)
        return not (record.name == "root" and record.levelno < logging.WARNING and from_package)


def lightning_lines_once() -> None:
    """Lightning's package logger (`lightning`) prints each line with a console handler of its own, added when it is
    imported, and the line reaches the stage's root handler too: where the root has a handler, Lightning's own is
    removed, so each line appears once, timestamped and named like the rest. Call it once Lightning is imported."""
    if not logging.getLogger().handlers:
        return
    package = logging.getLogger("lightning")
    for handler in list(package.handlers):
        package.removeHandler(handler)
    logger, pattern, path = LITLOGGER_TIP
    drop_once(logging.getLogger(logger), DroppedLine(pattern, path))
