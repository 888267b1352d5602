"""The `export` stage's work: FP32 TorchScript (traced) and ONNX (torch.export-based exporter) exports.

Both take `input_ids` and `attention_mask` with dynamic batch and sequence axes and return logits; both
are checked for parity against the PyTorch model on real reviews before they are written as variants."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import UserError
from pipeline.core.params import ExportParams, to_dict
from pipeline.data.tokens import read_tokenized
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.base import Runner, Runtime, pad_batch
from pipeline.runtimes.catalog import built_by, directories
from pipeline.runtimes.eager import TorchRunner, logits_module
from pipeline.runtimes.ort import OrtRunner
from pipeline.runtimes.record import VariantInfo, building, write_skipped, write_variant
from pipeline.runtimes.torchscript import (
    TORCHSCRIPT_DEPRECATION,
    TorchScriptRunner,
    checked_trace,
    legacy_torchscript,
)

log = logging.getLogger(__name__)


class ExportError(UserError):
    """An export failed or its output disagrees with the PyTorch model."""


def example_inputs(max_length: int, batch: int = 2,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A padded example batch: row 0 full length, row 1 half padding, so traced masking is general."""
    length = min(max_length, 32)
    ids = torch.randint(1000, 2000, (batch, length), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1:, length // 2 :] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (examples for tracing and export must live there too)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def export_torchscript(model: torch.nn.Module, path: Path, max_length: int) -> None:
    """Trace the model; shapes stay symbolic so any batch and length up to the max are accepted (`run_export`
    checks the trace at other batch sizes and lengths: `checked_trace`)."""
    model.eval()
    wrapper = logits_module(model).eval()
    with torch.inference_mode(False), torch.no_grad(), checked_trace():
        example = example_inputs(max_length, device=device_of(model))
        traced = torch.jit.trace(wrapper, example, check_trace=False, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        traced.save(str(path))


def export_onnx(model: torch.nn.Module, path: Path, max_length: int, opset: int) -> None:
    """ONNX via the torch.export-based exporter with dynamic batch/sequence dims, then `onnx.checker`. `opset` is
    `export.opset` for every ONNX file the pipeline exports (fp32-onnx and each graph the INT8 builders export)."""
    import onnx

    model.eval()
    wrapper = logits_module(model).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=2, max=max_length)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        example = example_inputs(max_length, device=device_of(model))
        program = torch.onnx.export(wrapper, example, dynamo=True, opset_version=opset,
                                    input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                    dynamic_shapes=shapes, optimize=True, verbose=False)
        program.save(str(path), external_data=False)
        onnx.checker.check_model(str(path), full_check=True)  # inside: a graph it rejects is an ExportError too
    except Exception as exc:
        raise ExportError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class Parity:
    """How far a variant's logits are from the reference on the same batch."""

    max_abs_diff: float
    label_agreement: float
    batch: int


@dataclass(frozen=True)
class ReferenceBatch:
    """One padded batch of real reviews and the reference's logits on it, computed once for every parity check
    of the same export (the file as written and as served)."""

    ids: np.ndarray
    mask: np.ndarray
    logits: np.ndarray

    @classmethod
    def of(cls, reference: Runner, seqs: Sequence[np.ndarray], pad_id: int = 0) -> ReferenceBatch:
        ids, mask = pad_batch(seqs, pad_id)
        return cls(ids, mask, reference(ids, mask))

    def parity(self, candidate: Runner) -> Parity:
        """How far `candidate`'s logits on this batch are from the reference's."""
        got = candidate(self.ids, self.mask)
        return Parity(float(np.abs(self.logits - got).max()),
                      float((self.logits.argmax(-1) == got.argmax(-1)).mean()), len(self.ids))


def parity(reference: Runner, candidate: Runner, seqs: Sequence[np.ndarray], pad_id: int = 0) -> Parity:
    """Compare logits on one padded batch of real reviews."""
    return ReferenceBatch.of(reference, seqs, pad_id).parity(candidate)


def eager_runner(model: torch.nn.Module) -> Runner:
    """The PyTorch reference as a runner."""
    return TorchRunner(logits_module(model.eval()))


#: check_dynamic_shapes' bound on random token ids (not reviews, so not `export.parity_tolerance`'s check): a graph
#: specialised to its traced shape disagrees by whole logits, float reordering by far less than this.
SHAPE_CHECK_TOLERANCE = 1e-3


def check_dynamic_shapes(candidate: Runner, reference: Runner, max_length: int) -> None:
    """The export must accept other batch sizes and lengths than it was traced with."""
    rng = np.random.default_rng(0)
    for batch, length in ((1, 8), (3, max_length), (5, max(8, max_length // 2))):
        ids = rng.integers(1000, 2000, size=(batch, length))
        mask = np.ones_like(ids)
        diff = float(np.abs(candidate(ids, mask) - reference(ids, mask)).max())
        if diff > SHAPE_CHECK_TOLERANCE:
            raise ExportError(f"export disagrees at batch={batch} length={length}: max |diff| = {diff:.2e} > "
                              f"{SHAPE_CHECK_TOLERANCE:.0e}")


def describe(model: Any) -> dict[str, Any]:
    """Architecture facts the builders need (heads, hidden size) from the HF config."""
    cfg = model.config
    return {"num_heads": int(cfg.num_attention_heads), "hidden_size": int(cfg.hidden_size),
            "num_layers": int(cfg.num_hidden_layers), "model_type": str(cfg.model_type),
            "intermediate_size": int(getattr(cfg, "intermediate_size", getattr(cfg, "hidden_dim", 0)))}


def max_length_of(meta: dict[str, Any]) -> int:
    return int(meta["preprocessing"]["max_length"])


def inference_model(model: Any, cls_readout: bool) -> tuple[Any, dict[str, Any]]:
    """The model as it is exported, and the record of it: with the [CLS] readout (`pipeline.runtimes.readout`) when
    asked for and possible, else the model itself with the reason logged and recorded."""
    from pipeline.runtimes.readout import cls_readout as readout
    from pipeline.runtimes.readout import unsupported

    reason = "export.cls_readout is false" if not cls_readout else unsupported(model)
    if reason is not None:
        if cls_readout:
            log.warning("exporting the whole last layer: %s", reason)
        return model, {"cls_readout": False, "cls_readout_reason": reason}
    return readout(model), {"cls_readout": True}


def run_export(*, finetuned: Path, tokenized: Path, variants_root: Path, params: ExportParams) -> dict[str, Any]:
    """`fp32-onnx` and, when `export.torchscript`, `fp32-torchscript` (with the [CLS] readout when
    `export.cls_readout`), each checked for parity against the unchanged PyTorch model on real test reviews and
    built whole or not at all (`building`)."""
    model, tokenizer, meta = load_finetuned(finetuned)
    max_len = max_length_of(meta)
    seqs = read_tokenized(tokenized, "test")["input_ids"].tolist()[: params.parity_samples]
    reference = eager_runner(model)
    graph, readout = inference_model(model, params.cls_readout)
    report: dict[str, Any] = {}
    out_dirs = directories(variants_root, built_by("export"))

    d = out_dirs["fp32-torchscript"]
    if params.torchscript:
        with building(d) as work:
            t0 = time.perf_counter()
            export_torchscript(graph, work / "model.pt", max_len)
            with legacy_torchscript():
                runner = TorchRunner(torch.jit.load(str(work / "model.pt")))
            batch = ReferenceBatch.of(reference, seqs, pad_id(tokenizer))
            report["fp32-torchscript"] = {**_checked(batch, reference, runner, params, max_len, t0),
                                          **served_parity(batch, TorchScriptRunner, "fp32-torchscript", work, params)}
            write_variant(work, VariantInfo.built("fp32-torchscript", {"method": "torch.jit.trace", **readout,
                                                                        "deprecated_api": TORCHSCRIPT_DEPRECATION,
                                                                        **report["fp32-torchscript"]}), finetuned)
    else:
        reason = "export.torchscript is false (make run PROFILE=full builds it)"
        write_skipped(d, VariantInfo.skipped("fp32-torchscript", reason, to_dict(params)), finetuned)
        report["fp32-torchscript"] = {"status": "skipped", "reason": reason}

    # fp32-onnx is exported in eager attention, the form onnxscript's attention fusion matches at any head count
    # (`pipeline.variants.fusion`): the quantize stage fuses this file as it is instead of exporting the model again.
    model.set_attn_implementation("eager")
    graph, readout = inference_model(model, params.cls_readout)  # the readout built again, on eager attention
    report["fp32-onnx"] = onnx_variant("fp32-onnx", model, graph=graph, readout=readout,
                                       directory=out_dirs["fp32-onnx"], model_dir=finetuned, seqs=seqs, params=params,
                                       max_len=max_len, pad_id=pad_id(tokenizer))
    return report


def attention_of(model: Any) -> str:
    """The attention implementation a Hugging Face model runs (`eager`, `sdpa`, ...), as its variant records it."""
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


def onnx_variant(name: str, model: Any, *, graph: Any, readout: dict[str, Any], directory: Path, model_dir: Path,
                 seqs: list[np.ndarray], params: ExportParams, max_len: int, pad_id: int) -> dict[str, Any]:
    """An FP32 ONNX variant of `model` (exported from `graph`, its inference form): parity-checked against the
    unchanged model on real reviews, recorded with its architecture and readout; `model_dir` is the HF directory
    whose tokenizer and record go with it (the finetuned teacher's, or the distilled student's). `directory` is
    replaced whole once the record is written (`building`)."""
    with building(directory) as work:
        t0 = time.perf_counter()
        export_onnx(graph, work / "model.onnx", max_len, params.opset)
        runner = OrtRunner(work / "model.onnx", optimization="disable")
        reference = eager_runner(model)
        batch = ReferenceBatch.of(reference, seqs, pad_id)
        checked = {**_checked(batch, reference, runner, params, max_len, t0),
                   **served_parity(batch, OrtRunner, name, work, params)}
        write_variant(work, VariantInfo.built(name, {"method": "torch.onnx.export(dynamo=True)", "opset": params.opset,
                                                     "attention": attention_of(model), **describe(model), **readout,
                                                     **checked}), model_dir)
    return checked


def served_parity(batch: ReferenceBatch, runtime: type[Runtime], name: str, work: Path,
                  params: ExportParams) -> dict[str, float]:
    """The variant file in `work` loaded by `runtime` as the evaluate stage and both servers load it (its defaults:
    onnxruntime's graph optimizations on, a TorchScript module frozen and optimized for inference) and checked
    against the reference on `batch`. The parity check of the file as written (`_checked`) covers the exporter;
    this one covers what is served, whose optimizer passes rewrite the graph again."""
    p = within_tolerance(batch.parity(runtime.load(work, VariantInfo.built(name, {}))), params,
                         f"parity of {name} as served")
    return {"served_parity_max_abs_diff": p.max_abs_diff}


def within_tolerance(p: Parity, params: ExportParams, check: str) -> Parity:
    """`p`, or an `ExportError` naming `check` where its logits are further than `export.parity_tolerance`."""
    if p.max_abs_diff > params.parity_tolerance:
        raise ExportError(f"{check} failed: max |logit diff| {p.max_abs_diff:.2e} > {params.parity_tolerance:.0e}")
    return p


def _checked(batch: ReferenceBatch, reference: Runner, runner: Runner, params: ExportParams, max_len: int,
             started: float) -> dict[str, Any]:
    """The file as written (`runner`) against the reference on `batch`, then at other batch sizes and lengths."""
    p = within_tolerance(batch.parity(runner), params, "parity")
    check_dynamic_shapes(runner, reference, max_len)
    return {"parity_max_abs_diff": p.max_abs_diff, "parity_batch": p.batch,
            "export_seconds": round(time.perf_counter() - started, 2)}
