"""Unit: the FP32 exports (TorchScript, ONNX) of a tiny BERT: parity with PyTorch, what they record."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.params import ExportParams
from pipeline.runtimes.record import read_variant
from pipeline.variants.export import ExportError, Parity, run_export
from tests.factories import write_tokenized


def test_fp32_exports_match_pytorch_as_written_and_as_served(built):
    for name in ("fp32-torchscript", "fp32-onnx"):
        assert built["export"][name]["parity_max_abs_diff"] <= 1e-4
        assert built["export"][name]["served_parity_max_abs_diff"] <= 1e-4  # optimized / frozen as served
        info = read_variant(built["dirs"][name])
        assert info.dtype == "float32" and info.status == "ok"
        assert info.params["served_parity_max_abs_diff"] == built["export"][name]["served_parity_max_abs_diff"]


def test_every_export_records_the_cls_readout(built):
    for name in ("fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat"):
        assert read_variant(built["dirs"][name]).params["cls_readout"] is True, name


def test_parity_failure_stops_export(tmp_path, tiny_model_dir, monkeypatch):
    import pipeline.variants.export as build

    monkeypatch.setattr(build.ReferenceBatch, "parity",
                        lambda *a, **k: Parity(max_abs_diff=1.0, label_agreement=0.5, batch=1))
    tok_dir = write_tokenized(tmp_path / "tok", {"test": 8})
    with pytest.raises(ExportError, match="parity failed"):
        run_export(finetuned=tiny_model_dir, tokenized=tok_dir, variants_root=tmp_path / "variants",
                   params=ExportParams())


def test_a_served_form_that_answers_differently_stops_export(tmp_path, tiny_model_dir, monkeypatch, exported_as_built):
    """The file as written can match PyTorch while the runtime's own passes, applied when it is served, change the
    answers: the export checks the variant loaded as served too, and publishes nothing when that fails."""
    from pipeline.runtimes.ort import OrtRunner

    real_load = OrtRunner.load.__func__

    def drifting_load(cls, directory, info, threads=None, **options):
        runner = real_load(cls, directory, info, threads, **options)
        return lambda ids, mask: runner(ids, mask) + 0.5

    monkeypatch.setattr(OrtRunner, "load", classmethod(drifting_load))
    tok_dir = write_tokenized(tmp_path / "tok", {"test": 8})
    with pytest.raises(ExportError, match="parity of fp32-onnx as served failed"):
        run_export(finetuned=tiny_model_dir, tokenized=tok_dir, variants_root=tmp_path / "variants",
                   params=ExportParams(parity_samples=4, torchscript=False))
    assert not (tmp_path / "variants" / "fp32-onnx").exists()


def test_a_profile_opting_out_of_torchscript_gets_a_skip_record_with_the_reason(tmp_path, tiny_model_dir,
                                                                                 exported_as_built):
    """The default builds fp32-torchscript; `export.torchscript: false` (a profile opting out for speed) still builds
    fp32-onnx, and fp32-torchscript is a skipped variant whose reason names the setting."""
    assert ExportParams().torchscript
    tok_dir = write_tokenized(tmp_path / "tok", {"test": 8})
    report = run_export(finetuned=tiny_model_dir, tokenized=tok_dir, variants_root=tmp_path / "variants",
                        params=ExportParams(parity_samples=4, torchscript=False))
    assert report["fp32-torchscript"]["status"] == "skipped"
    info = read_variant(tmp_path / "variants" / "fp32-torchscript")
    assert info.status == "skipped" and "export.torchscript" in info.reason
    assert not (tmp_path / "variants" / "fp32-torchscript" / "model.pt").exists()
    assert read_variant(tmp_path / "variants" / "fp32-onnx").status == "ok"


def test_a_graph_the_onnx_checker_rejects_is_an_export_error(tmp_path, monkeypatch):
    """The exported file failing `onnx.checker` is the module's `ExportError` with the checker's message, like a
    failed export, not a raw `ValidationError`."""
    import onnx
    import torch

    import pipeline.variants.export as build

    class Program:
        def save(self, path: str, external_data: bool) -> None:
            Path(path).write_bytes(b"not a graph")

    def rejects(path: str, full_check: bool) -> None:
        raise onnx.checker.ValidationError("Field 'type' of 'value_info' is required but missing")

    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: Program())
    monkeypatch.setattr(onnx.checker, "check_model", rejects)
    with pytest.raises(ExportError, match="ONNX export failed: ValidationError: Field 'type'"):
        build.export_onnx(torch.nn.Identity(), tmp_path / "model.onnx", max_length=16, opset=18)


def _traced_noise(trace) -> tuple[list[str], list[str]]:
    """(warnings, transformers.modeling_utils log lines) while `trace` runs, every warning shown."""
    import logging
    import warnings

    from tests.factories import log_records

    logging.Logger.warning_once.cache_clear()  # transformers says it once per process: say it again
    with log_records("transformers.modeling_utils") as records, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace()
    return [f"{w.category.__name__}: {w.message}" for w in caught], [r.getMessage() for r in records]


def test_tracing_says_nothing_of_the_properties_the_tracer_reads(tmp_path):
    """What transformers says while torch.jit reads every property of a model it traces (`is_gradient_checkpointing`
    is deprecated; `ForCausalLMLoss` for a submodule without a loss), and the tracer's own warnings about traced
    shapes, which `check_dynamic_shapes` covers, stay out of the export's output; the same trace made directly
    says all three, so the check can fail."""
    import torch

    from pipeline.core.params import ModelParams
    from pipeline.modeling import load_model
    from pipeline.runtimes.eager import logits_module
    from pipeline.variants.export import example_inputs, export_torchscript

    model = load_model(ModelParams(source="tiny"), seed=0).eval()

    def direct() -> None:  # the trace export_torchscript makes, without its filters (torch.jit's own aside)
        import warnings

        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        with torch.no_grad():
            torch.jit.trace(logits_module(model).eval(), example_inputs(32), check_trace=False, strict=False)

    said, logged = _traced_noise(direct)
    assert any("is_gradient_checkpointing" in w for w in said), said
    assert any(w.startswith("TracerWarning") for w in said), said
    assert any("ForCausalLMLoss" in line for line in logged), logged
    said, logged = _traced_noise(lambda: export_torchscript(model, tmp_path / "model.pt", 32))
    assert not [w for w in said if "is_gradient_checkpointing" in w or w.startswith("TracerWarning")], said
    assert not [line for line in logged if "ForCausalLMLoss" in line], logged
    assert (tmp_path / "model.pt").stat().st_size > 0
