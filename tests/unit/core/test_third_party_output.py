"""What a stage process leaves unshown of its libraries' output (`pipeline.core.third_party_output`): each filter drops
its one message and lets the rest of the same source through."""

from __future__ import annotations

import logging
import os
import warnings

from pipeline.core.third_party_output import (
    THIRD_PARTY_LINES,
    THIRD_PARTY_WARNINGS,
    DroppedLine,
    QuietThirdPartyRootInfo,
    lightning_lines_once,
    quiet_third_party_warnings,
)
from tests.factories import log_records


def _record(name: str, level: int, path: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, path, 1, "message", None, None)


def test_root_info_from_onnxruntime_is_dropped_but_warnings_and_our_lines_stay():
    quiet = QuietThirdPartyRootInfo()
    ort = os.sep.join(["", "venv", "site-packages", "onnxruntime", "quantization", "qdq_quantizer.py"])
    ours = os.sep.join(["", "repo", "pipeline", "quantize.py"])
    assert not quiet.filter(_record("root", logging.INFO, ort))
    assert not quiet.filter(_record("root", logging.DEBUG, ort))
    assert quiet.filter(_record("root", logging.WARNING, ort))
    assert quiet.filter(_record("root", logging.INFO, ours))
    assert quiet.filter(_record("pipeline.quantize", logging.INFO, ours))
    # a named onnxruntime logger is left to its own level
    assert quiet.filter(_record("onnxruntime.quantization.preprocess", logging.INFO, ort))


def test_onnxruntimes_pre_processing_advice_is_dropped_and_its_other_warnings_stay():
    """The advice onnxruntime's quantizers print on the fused graphs (which its pre-processing cannot type) goes;
    the same words from elsewhere and onnxruntime's other warnings stay."""
    advice = next(DroppedLine(pattern, path) for logger, pattern, path in THIRD_PARTY_LINES if logger == "")
    ort = os.sep.join(["", "venv", "site-packages", "onnxruntime", "quantization", "quantize.py"])

    def warning(path: str, message: str) -> logging.LogRecord:
        return logging.LogRecord("root", logging.WARNING, path, 1, message, None, None)

    for message in ("Please consider to run pre-processing before quantization. Refer to example: https://x",
                    "Please consider pre-processing before quantization. See https://x"):
        assert not advice.filter(warning(ort, message))
    assert advice.filter(warning(ort, "Quantization parameters for tensor x not specified"))
    assert advice.filter(warning(os.sep.join(["", "repo", "pipeline", "q.py"]),
                                 "run pre-processing before quantization"))


def test_a_stage_logs_no_pre_processing_advice_from_a_real_quantizer_call(tmp_path, capfd):
    """setup_logging's root handler drops the advice that onnxruntime's `quantize_dynamic` prints for a graph
    that did not go through its pre-processing, so the test fails if the filter is not installed or the message
    changes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import quantize_dynamic

    from pipeline.core.stage import setup_logging

    weight = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    root = logging.getLogger()
    saved = list(root.handlers)
    for handler in saved:
        root.removeHandler(handler)
    try:
        setup_logging()  # basicConfig: a stderr handler on the root logger, with the stage's filters
        quantize_dynamic(tmp_path / "m.onnx", tmp_path / "q.onnx")
        for handler in list(root.handlers):
            root.removeHandler(handler)
    finally:
        for handler in saved:
            root.addHandler(handler)
    assert "pre-processing before quantization" not in capfd.readouterr().err
    assert (tmp_path / "q.onnx").is_file()


def test_lightning_lines_appear_once_through_the_root_handler_without_the_litlogger_tip():
    import io

    import lightning  # noqa: F401  (importing it adds its console handler to the "lightning" logger)

    root, package = logging.getLogger(), logging.getLogger("lightning")
    root_out, own_out = io.StringIO(), io.StringIO()
    root_handler, own_handler = logging.StreamHandler(root_out), logging.StreamHandler(own_out)
    saved = list(package.handlers)
    root.addHandler(root_handler)
    package.addHandler(own_handler)  # stands for the handler `import lightning` adds, whichever test imported it
    try:
        lightning_lines_once()
        log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        log.info("GPU available: False, used: False")
        log.info("💡 Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/project/litlogger/)")
    finally:
        root.removeHandler(root_handler)
        for handler in list(package.handlers):
            package.removeHandler(handler)
        for handler in saved:
            package.addHandler(handler)
    assert root_out.getvalue().splitlines() == ["GPU available: False, used: False"]
    assert own_out.getvalue() == ""


def test_torchaos_enum_constant_notice_is_dropped_and_the_loggers_other_messages_pass():
    """torchao's import makes PyTorch's pytree logger say that two of torchao's Enums need no registration; a stage
    process drops that notice (a call of torchao's) and keeps whatever else the logger says."""
    from pipeline.core.stage import setup_logging

    setup_logging()
    pytree = logging.getLogger("torch.utils._pytree")
    with log_records(pytree.name) as records:
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
                       "value type. Calling register_constant() on Enum subclasses is deprecated",
                       "<enum 'KernelPreference'>")
        pytree.warning("some other pytree warning")
    assert [r.getMessage() for r in records] == ["some other pytree warning"]


def test_the_third_party_warnings_are_hidden_and_the_same_words_from_our_code_are_not():
    """Each warning as its library raises it (message, category, the module it is attributed to) is hidden; the
    same message attributed to a pipeline module still shows."""
    raised = [
        ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning,
         "copyreg"),
        ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning,
         "lightning.pytorch.utilities._pytree"),
        ("# The axis name: batch will not be used, since it shares the same shape constraints with another axis: "
         "batch.", UserWarning, "torch.onnx._internal.exporter._onnx_program"),
        ("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop.", UserWarning,
         "lightning.pytorch.trainer.configuration_validator"),
        ("Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be "
         "accurate. Using 32 bits instead.", UserWarning, "lightning.pytorch.utilities.model_summary.model_summary"),
    ]
    assert len(raised) == len(THIRD_PARTY_WARNINGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_warnings()
        for message, category, module in raised:
            warnings.warn_explicit(message, category, "library.py", 1, module=module)
        for message, category, _ in raised:
            warnings.warn_explicit(message, category, "ours.py", 1, module="pipeline.variants.export")
    assert [str(w.message) for w in caught] == [message for message, _, _ in raised]


def test_the_exporters_torchvision_lines_are_dropped_and_its_other_warnings_pass():
    from pipeline.core.stage import setup_logging

    setup_logging()
    exporter = logging.getLogger("torch.onnx._internal.exporter._registration")
    assert any(isinstance(f, DroppedLine) for f in exporter.filters)
    with log_records(exporter.name) as records:
        exporter.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        exporter.warning("some other exporter warning")
    assert [r.getMessage() for r in records] == ["some other exporter warning"]
