"""What third-party libraries print that a stage process does not show, each with the reason: log lines (logger
levels and filters) and warnings (`THIRD_PARTY_WARNINGS`, which tests/conftest.py gives pytest too, so the tests
and the stages hide the same ones). Each is a library's note on its own code, or on a configuration the pipeline
chose on purpose, with nothing for the pipeline to change; everything else those libraries say is shown."""

from __future__ import annotations

import builtins
import logging
import os
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
    for logger, kind in (("torch.utils._pytree", NoEnumConstantNotice),
                         ("torch.onnx._internal.exporter._registration", NoTorchvisionSkipNotice)):
        if not any(isinstance(f, kind) for f in logging.getLogger(logger).filters):
            logging.getLogger(logger).addFilter(kind())
    for handler in logging.getLogger().handlers:
        for kind in (QuietThirdPartyRootInfo, NoPreProcessAdvice):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())
    quiet_third_party_warnings()


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


class NoPreProcessAdvice(logging.Filter):
    """Drops onnxruntime's advice to run its quantization pre-processing (`quant_pre_process`: shape inference and
    graph optimization), a root-logger warning of every quantizer call on a graph without the metadata that step
    writes. The quantize stage has done what it asks or chosen not to (`pipeline.variants.onnx_int8`): by default it
    quantizes onnxruntime's own fused graph (`quantize.optimize_graph`), whose contrib ops that step cannot type
    (`typed_contrib_outputs` types them); the static quantizer's unfused input goes through that step; and an
    unfused graph that dynamic quantization reads is unfused because the params ask for it. Any other warning of
    onnxruntime's passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        from_ort = f"{os.sep}onnxruntime{os.sep}quantization{os.sep}" in record.pathname
        return not (from_ort and "pre-processing before quantization" in record.getMessage())


class NoEnumConstantNotice(logging.Filter):
    """Drops PyTorch's notice that registering an Enum as a pytree constant is deprecated, which torchao's import
    (transformers imports torchao in every process that loads a model) prints for two of its own Enums: a call of
    torchao's, not the pipeline's. Every other message of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


class NoTorchvisionSkipNotice(logging.Filter):
    """Drops the ONNX exporter's line for each torchvision operator it does not register because torchvision is not
    installed (the pipeline's models use none). Every other message of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("torchvision is not installed")


class NoLitLoggerTip(logging.Filter):
    """Drops Lightning's advertisement for its hosted logger, printed by every Trainer that has another logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage().lower()


def lightning_lines_once() -> None:
    """Lightning's package logger (`lightning`) prints each line with a console handler of its own, added when it is
    imported, and the line reaches the stage's root handler too: where the root has a handler, Lightning's own is
    removed, so each line appears once, timestamped and named like the rest. Call it once Lightning is imported."""
    if not logging.getLogger().handlers:
        return
    package = logging.getLogger("lightning")
    for handler in list(package.handlers):
        package.removeHandler(handler)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, NoLitLoggerTip) for f in rank_zero.filters):
        rank_zero.addFilter(NoLitLoggerTip())
