"""`int8-qat`: quantization-aware training with torch.ao's fake quantizers on the finetuned model (the
finetune stage's training window, distilled from FP32), then onnxruntime's static QDQ conversion with the
calibration method int8-static chose. The QAT model's graph is fused as int8-static's is: fp32-onnx's graph
refilled with the QAT weights where it can be, an export of the QAT model otherwise."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.modeling import load_finetuned
from pipeline.variants.export import eager_runner, export_onnx, inference_model, max_length_of
from pipeline.variants.fusion import FusionCheck, fuse_export, fused_graph
from pipeline.variants.onnx_int8 import QuantizeError, quantize_static_onnx
from pipeline.variants.quantize_inputs import QuantizeInputs, fusion_check, qat_reviews

log = logging.getLogger(__name__)


#: The checkpoint job of int8-qat's finetune (`train.checkpoint_dir/qat`); the stage clears it once the variant is
#: published.
CHECKPOINT_JOB = "qat"


def qat_onnx(inputs: QuantizeInputs, method: str, out: Path) -> dict[str, Any]:
    """`int8-qat`: QAT on `params.qat_train_samples` training reviews (in the finetune stage's training window),
    then the static QDQ conversion with the calibration `method` int8-static chose. The QAT finetune checkpoints and
    resumes under `train.checkpoint_dir/qat` like the other training jobs (`qat_checkpoints`)."""
    from pipeline.core.io import token_fingerprint
    from pipeline.surgery.fake_quant import FAKE_QUANT_API
    from pipeline.training.qat import QatRun, qat_checkpoints, qat_finetune

    params, train = inputs.q, inputs.params.train
    model, _, _ = load_finetuned(inputs.finetuned)  # a fresh copy: QAT changes the weights it trains
    model.train()
    reviews, labels = qat_reviews(inputs, params.qat_train_samples)
    settings = {"qat_epochs": params.qat_epochs, "qat_batch_size": params.qat_batch_size, "qat_lr": params.qat_lr,
                "qat_distillation": params.qat_distillation, "weight_format": params.weight_format,
                "qat_precision": params.trainer_precision(),
                "ffn_width": inputs.ffn_width, "reviews": token_fingerprint(reviews),
                "labels": token_fingerprint([labels])}
    store, plan = qat_checkpoints(train, CHECKPOINT_JOB, settings, model, [inputs.finetuned], code=(),
                                  quantize=params)
    run = QatRun(reviews=reviews, labels=labels, params=params, lr=params.qat_lr, seed=train.seed,
                 pad_id=inputs.pad_id, store=store, plan=plan)
    result = qat_finetune(model, run, inputs.ffn_width)
    graph, readout = inference_model(model, inputs.cls_readout)  # qat_finetune leaves the model in eval mode
    if params.optimize_graph:
        # The same fused graph as int8-static's, checked against the QAT model itself in PyTorch (as the export
        # stage checks fp32-onnx).
        src, fusion = _qat_fused_graph(inputs, model, graph, readout,
                                       fusion_check(inputs, eager_runner(model), "the QAT model (PyTorch)"))
    else:
        src, fusion = inputs.tmp / "qat-fp32.onnx", {}
        export_onnx(graph, src, max_length_of(inputs.meta), inputs.params.export.opset)
    out.mkdir(parents=True, exist_ok=True)
    quantize_static_onnx(src, out / "model.onnx", inputs.calibration, method, params, inputs.pad_id,
                         inputs.ffn_width)
    linears = "every Linear but the FFN down-projections (quantized per batch)" if inputs.ffn_width else "every Linear"
    return {"method": f"QAT ({FAKE_QUANT_API} on {linears}) + onnxruntime QDQ", "calibration": method,
            **run.record(result.steps, result.final_loss), "fake_quant_layers": result.wrapped_layers,
            "dynamic_ffn_output": inputs.ffn_width is not None, "fused_graph": params.optimize_graph, **fusion,
            **readout}


def _qat_fused_graph(inputs: QuantizeInputs, model: Any, graph: Any, readout: dict[str, Any],
                     check: FusionCheck) -> tuple[Path, dict[str, Any]]:
    """The QAT model's fused graph (`graph`, `readout`: `inference_model` of the QAT `model`). QAT changes the
    weights, not the architecture, so where fp32-onnx holds the eager-attention graph the fusion needs, that graph
    with the QAT weights put in (`refill_weights`) is fused instead of exporting the QAT model again; otherwise, or
    where the graph cannot be refilled or its fusion fails the check, the QAT model is exported (`fused_graph`).
    The record says which (`qat_graph`)."""
    from pipeline.variants.onnx_weights import refill_weights

    tmp = inputs.tmp / "qat"
    tmp.mkdir(exist_ok=True)
    model.set_attn_implementation("eager")  # the reference `check` runs it: the form both graphs are in
    if inputs.arch.get("attention") == "eager":
        before, _ = inference_model(inputs.model, inputs.cls_readout)  # fp32-onnx's tensors, under graph's names
        raw = tmp / "refilled.onnx"
        if refill_weights(inputs.fp32_onnx / "model.onnx", raw, _tensors(before), _tensors(graph)) is not None:
            try:
                src, fusion = fuse_export(raw, readout, check, tmp)
                return src, {**fusion, "qat_graph": "fp32-onnx's graph with the QAT weights"}
            except QuantizeError as exc:
                log.warning("the refilled QAT graph failed its check (%s): exporting the QAT model instead", exc)
    src, fusion = fused_graph(model, inputs.cls_readout, check, tmp, opset=inputs.params.export.opset)
    return src, {**fusion, "qat_graph": "exported from the QAT model"}


def _tensors(model: Any) -> dict[str, np.ndarray]:
    """A model's parameters and buffers by name, as numpy arrays."""
    return {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}
