"""The distilled student's variants, built by the teacher's own paths: `fp32-distilled` through the export
stage's ONNX export and parity check (`onnx_variant`), `int8-distilled` through int8-dynamic's recipe (fused graph,
dynamic INT8: `fused_dynamic_int8`) and `int8-distilled-openvino` through int8-openvino's (`torch.export`, NNCF
static INT8 on the same calibration reviews: `quantize_openvino`), each with the [CLS] readout when
`export.cls_readout`. A skipped student gives skipped variants with its reason."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.core.machine import Choice
from pipeline.core.params import Params, to_dict
from pipeline.data.tokens import read_tokenized
from pipeline.modeling import load_finetuned, pad_id, read_model_record
from pipeline.runtimes.catalog import built_by, directories
from pipeline.runtimes.record import VariantInfo, building, write_skipped, write_variant

log = logging.getLogger(__name__)


def skipped_reason(student_dir: Path) -> str | None:
    """Why the distill stage wrote no student (its record says so), or None when it did."""
    record = read_model_record(student_dir)
    return record["reason"] if record.get("status") == "skipped" else None


def run_distilled_variants(*, student_dir: Path, tokenized: Path, variants_root: Path, params: Params,
                           weight_format: Choice) -> dict[str, Any]:
    """`fp32-distilled`, `int8-distilled` and `int8-distilled-openvino` from the student in `student_dir` (the first
    two parity-checked on real reviews against the student in PyTorch); int8-distilled's weights in `weight_format`
    (how the stage resolved `quantize.weight_format`)."""
    out = directories(variants_root, built_by("distill"))
    reason = skipped_reason(student_dir)
    if reason is not None:
        for name, d in out.items():
            write_skipped(d, VariantInfo.skipped(name, reason, to_dict(params.distill)), student_dir)
        return {name: {"status": "skipped", "reason": reason} for name in out}
    # the builders (torch, onnxruntime, OpenVINO) only where there is a student to build from
    from pipeline.variants.calibration import calibration_reviews
    from pipeline.variants.export import inference_model, max_length_of, onnx_variant
    from pipeline.variants.fusion import FusionCheck, fused_dynamic_int8
    from pipeline.variants.openvino_int8 import quantize_openvino

    model, tokenizer, meta = load_finetuned(student_dir)
    pad = pad_id(tokenizer)
    max_len = max_length_of(meta)
    report: dict[str, Any] = {}
    seqs = read_tokenized(tokenized, "test")["input_ids"].tolist()[: params.export.parity_samples]
    graph, readout = inference_model(model, params.export.cls_readout)
    report["fp32-distilled"] = onnx_variant("fp32-distilled", model, graph=graph, readout=readout,
                                            directory=out["fp32-distilled"], model_dir=student_dir, seqs=seqs,
                                            params=params.export, max_len=max_len, pad_id=pad)

    started = time.perf_counter()
    check = FusionCheck.of_model(model, "the distilled student", tokenized=tokenized, max_length=max_len, pad_id=pad,
                                 export=params.export)
    with building(out["int8-distilled"]) as work, tempfile.TemporaryDirectory(prefix="distilled-") as tmp:
        built = fused_dynamic_int8(model, "int8-distilled", work, check, export=params.export,
                                   per_channel=params.quantize.per_channel, weight_format=weight_format, tmp=Path(tmp))
        report["int8-distilled"] = {
            "method": "distilled student + onnxruntime.quantize_dynamic (int8-dynamic's recipe)", **built,
            "student_layers": int(model.config.num_hidden_layers),
            "build_seconds": round(time.perf_counter() - started, 2)}
        write_variant(work, VariantInfo.built("int8-distilled", report["int8-distilled"]), student_dir)

    name = "int8-distilled-openvino"
    calibration = calibration_reviews(read_tokenized(tokenized, "train"), params)
    started = time.perf_counter()
    with building(out[name]) as work:
        report[name] = {**quantize_openvino(graph, calibration, pad, params.quantize.calibration_batch_size, work),
                        **readout, "student_layers": int(model.config.num_hidden_layers),
                        "build_seconds": round(time.perf_counter() - started, 2)}  # as int8-distilled's and quantize's
        write_variant(work, VariantInfo.built(name, report[name]), student_dir)
    return report
