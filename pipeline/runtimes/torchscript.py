"""The TorchScript runtime: a traced module loaded, frozen and optimised for inference; and the one place the
project calls torch.jit's deprecated API on purpose (`legacy_torchscript`)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from pipeline.runtimes.base import checked_options, set_torch_threads
from pipeline.runtimes.eager import TorchRunner
from pipeline.runtimes.record import VariantError, VariantInfo, model_file

log = logging.getLogger(__name__)

#: Why the project still calls a deprecated API, recorded in the fp32-torchscript variant and logged.
TORCHSCRIPT_DEPRECATION = (
    "TorchScript (torch.jit trace/load/freeze) is deprecated in the pinned PyTorch in favour of torch.export "
    "and torch.compile; fp32-torchscript is kept because the project's export formats name TorchScript, and its "
    "deprecation warnings are caught only around these calls (`legacy_torchscript`)"
)
#: The other deliberate caller: OpenVINO's PyTorch frontend traces int8-qat-openvino's QAT model with torch.jit.
QAT_TRACE_DEPRECATION = (
    "int8-qat-openvino is converted by ov.convert_model through torch.jit.trace (deprecated in the pinned PyTorch): "
    "NNCF's trained quantizers reach OpenVINO's FakeQuantize only when traced (torch.export stops at their "
    "data-dependent checks), which is NNCF's documented QAT export"
)

_LOGGED_REASONS: set[str] = set()  # each reason is logged once per process

#: What transformers says while torch.jit traces one of its models: the tracer reads every attribute of each module
#: it converts, properties included, and two of them speak. `is_gradient_checkpointing` warns that it is deprecated,
#: and `loss_function` on a submodule without a loss of its own (`BertModel`) logs that it would use
#: `ForCausalLMLoss`. Neither is something the pipeline calls (its classifiers train with their own cross-entropy:
#: `pipeline.training.classifier`), so both are dropped while tracing, and only they.
TRACER_PROPERTY_WARNING = r"`is_gradient_checkpointing` is deprecated"
TRACER_PROPERTY_LOG = ("transformers.modeling_utils", "^`loss_type=")  # (logger, message regex)


@contextlib.contextmanager
def legacy_torchscript(reason: str = TORCHSCRIPT_DEPRECATION) -> Iterator[None]:
    """The places the project calls torch.jit's deprecated API on purpose, each with its `reason` (the
    TorchScript variant; OpenVINO's tracing of the QAT model, `QAT_TRACE_DEPRECATION`).

    torch.jit's own DeprecationWarnings are caught here (and only here; anywhere else the test suite turns them
    into errors), so are what transformers says of the properties the tracer reads (`TRACER_PROPERTY_WARNING`,
    `TRACER_PROPERTY_LOG`), and the reason is logged once per process."""
    if reason not in _LOGGED_REASONS:
        log.info("%s", reason)
        _LOGGED_REASONS.add(reason)
    from pipeline.core.third_party_output import DroppedLine

    hf_log, dropped = logging.getLogger(TRACER_PROPERTY_LOG[0]), DroppedLine(TRACER_PROPERTY_LOG[1])
    hf_log.addFilter(dropped)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
            warnings.filterwarnings("ignore", message=TRACER_PROPERTY_WARNING, category=FutureWarning)
            yield
    finally:
        hf_log.removeFilter(dropped)


@contextlib.contextmanager
def checked_trace(reason: str = TORCHSCRIPT_DEPRECATION) -> Iterator[None]:
    """`legacy_torchscript` around a torch.jit trace whose result its caller checks against the module it traced
    (the export at other batch sizes and lengths, `check_dynamic_shapes`; int8-qat-openvino's IR on validation
    reviews, `openvino_qat.parity`), so the tracer's own warnings (Python booleans of traced shapes in
    transformers' masking and attention code) are silenced too."""
    import torch

    with legacy_torchscript(reason), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


class TorchScriptRunner(TorchRunner):
    """A TorchScript variant, run like any module (`TorchRunner`) on the CPU."""

    format: ClassVar[str] = "torchscript"

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> TorchScriptRunner:
        """The variant's traced module, frozen and optimised for inference unless option `freeze` is False; any
        other option is a `VariantError`."""
        import torch

        options = checked_options("torchscript", options, {"freeze": (True, False)})
        if info is None:
            raise VariantError(f"{directory} has no variant record: TorchScript runs TorchScript variants only")
        path = model_file(directory, info)
        set_torch_threads(threads)
        with legacy_torchscript():
            module = torch.jit.load(str(path), map_location="cpu")
            module.eval()
            if options.get("freeze", True):
                module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
        return cls(module)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "runtime": "torchscript"}
