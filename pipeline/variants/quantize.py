"""The `quantize` stage's work: `int8-dynamic` (fused graph, dynamic INT8), `int8-openvino` (OpenVINO IR, NNCF
static INT8), `int8-static` (QDQ, calibration method chosen on validation reviews), `int8-qat` (QAT, then the
same QDQ conversion) and `int8-qat-openvino` (QAT through NNCF's quantizers, then OpenVINO IR)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.core.machine import Choice
from pipeline.core.params import Params, to_dict
from pipeline.data.tokens import read_tokenized
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.catalog import directories
from pipeline.runtimes.record import VariantInfo, building, read_variant, write_skipped, write_variant
from pipeline.training.checkpoints import CheckpointStore
from pipeline.variants import onnx_qat, openvino_qat
from pipeline.variants.calibration import calibration_reviews
from pipeline.variants.export import inference_model
from pipeline.variants.onnx_int8 import QuantizeError, int8_census, quantize_dynamic_onnx, weight_record
from pipeline.variants.onnx_qat import qat_onnx
from pipeline.variants.openvino_int8 import quantize_openvino
from pipeline.variants.openvino_qat import QatJob, qat_openvino
from pipeline.variants.quantize_inputs import QuantizeInputs, qat_reviews

log = logging.getLogger(__name__)


def _build_dynamic(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    q = inputs.q
    base, fusion = inputs.graph_for_quantization()
    quantize_dynamic_onnx(base, out / "model.onnx", q.per_channel, q.weights())
    return {"method": "onnxruntime.quantize_dynamic", "per_channel": q.per_channel, **weight_record(inputs.choice),
            "fused_graph": q.optimize_graph, **fusion, **int8_census(out, "int8-dynamic")}


def _build_openvino(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    graph, readout = inference_model(inputs.model, inputs.params.export.cls_readout)  # the graph fp32-onnx holds
    return {**quantize_openvino(graph, inputs.calibration, inputs.pad_id, inputs.q.calibration_batch_size, out),
            **readout}


def _build_static(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    q, best = inputs.q, inputs.static_calibration()
    # a rename: `inputs.tmp` is on the variants' filesystem (`scratch_directory`)
    (inputs.tmp / f"static-{best['method']}.onnx").replace(out / "model.onnx")
    return {"method": "onnxruntime.quantize_static (QDQ)", "calibration": best["method"],
            "fused_graph": inputs.q.optimize_graph, **best["fusion"],
            "calibration_samples": len(inputs.calibration), "per_channel": q.per_channel,
            **weight_record(inputs.choice), "dynamic_ffn_output": inputs.ffn_width is not None,
            "cls_readout": inputs.cls_readout, "selection_val_accuracy": best["scores"],
            **int8_census(out, "int8-static")}


def _build_qat(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    record = qat_onnx(inputs, inputs.static_calibration()["method"], out)
    return {**record, **int8_census(out, "int8-qat"), **weight_record(inputs.choice),
            "qat_precision_choice": inputs.qat_choice.tag()}


def _build_qat_openvino(inputs: QuantizeInputs, out: Path) -> dict[str, Any]:
    """`int8-qat-openvino` (`pipeline.variants.openvino_qat`): QAT reviews and int8-openvino's calibration."""
    from pipeline.variants.openvino_int8 import calibration_batches

    model, _, _ = load_finetuned(inputs.finetuned)  # a fresh copy: QAT changes the weights it trains
    graph, readout = inference_model(model, inputs.params.export.cls_readout)  # the graph int8-openvino converts
    reviews, labels = qat_reviews(inputs, inputs.q.qat_openvino_train_samples)
    job = QatJob(params=inputs.q, train=inputs.params.train, finetuned=inputs.finetuned, pad_id=inputs.pad_id,
                 calibration=calibration_batches(inputs.calibration, pad_id=inputs.pad_id,
                                             batch_size=inputs.q.calibration_batch_size),
                 reviews=reviews, labels=labels, check_reviews=inputs.val["input_ids"].tolist()[:16])
    return {**qat_openvino(graph, job, out), "calibration_samples": len(inputs.calibration), **readout,
            "qat_precision_choice": inputs.qat_choice.tag()}


#: The quantize stage's builders, one per variant of `quantize.build`, in the order they run (int8-qat reuses the
#: calibration method int8-static chose). Each writes its files into the directory it is given (`building`'s, which
#: replaces the variant's directory once the record is in it) and returns its record; `run_quantize` times it and
#: writes the built or skipped record the same way for all.
BUILDERS: dict[str, Callable[[QuantizeInputs, Path], dict[str, Any]]] = {
    "int8-dynamic": _build_dynamic,
    "int8-openvino": _build_openvino,
    "int8-static": _build_static,
    "int8-qat": _build_qat,
    "int8-qat-openvino": _build_qat_openvino,
}
#: The variants that train, and their checkpoint jobs (`train.checkpoint_dir/<job>`): kept until the variant's
#: directory is published, so a build killed after its training, in the conversion, resumes instead of training again.
CHECKPOINT_JOBS = {"int8-qat": onnx_qat.CHECKPOINT_JOB, "int8-qat-openvino": openvino_qat.CHECKPOINT_JOB}


def run_quantize(*, finetuned: Path, fp32_onnx: Path, tokenized: Path, variants_root: Path,
                 params: Params, choice: Choice, qat_precision: Choice) -> dict[str, Any]:
    """`int8-dynamic`, `int8-openvino`, `int8-static` (calibration method chosen on validation reviews), `int8-qat`
    and `int8-qat-openvino`, each when `quantize.build` lists it (the rest are written as skipped with the reason),
    with INT8 weights in the format `choice` (how the stage resolved `quantize.weight_format`; the OpenVINO
    variants' weights are NNCF's signed 8-bit); both QAT finetunes train in `qat_precision` (how the stage resolved
    `quantize.qat_precision`)."""
    log.info("quantize.weight_format: %s", choice.tag())
    log.info("quantize.qat_precision: %s", qat_precision.tag())
    # every builder below sees the resolved format and QAT precision
    q = dataclasses.replace(params.quantize, weight_format=choice.value, qat_precision=qat_precision.value)
    out = directories(variants_root)
    model, tokenizer, meta = load_finetuned(finetuned)
    arch = read_variant(fp32_onnx).params
    # Static QDQ starts from the fp32-onnx file, so its readout must be the one params ask for now.
    from pipeline.runtimes.readout import unsupported

    expected = params.export.cls_readout and unsupported(model) is None  # what export records (`inference_model`)
    if bool(arch.get("cls_readout", False)) != expected:
        raise QuantizeError(f"{fp32_onnx} was exported with cls_readout={arch.get('cls_readout')}; "
                            f"export.cls_readout is {params.export.cls_readout}: re-run the export stage")
    train = read_tokenized(tokenized, "train")
    report: dict[str, Any] = {}
    skipped = (f"not in quantize.build ({', '.join(q.build)}); "
               "add it there or run a profile that builds it (make run PROFILE=full)")
    with scratch_directory(variants_root, "quantize") as tmp:
        inputs = QuantizeInputs(
            finetuned=finetuned, fp32_onnx=fp32_onnx, model=model, tokenizer=tokenizer, meta=meta, arch=arch,
            pad_id=pad_id(tokenizer), train=train, val=read_tokenized(tokenized, "val").iloc[: q.selection_samples],
            calibration=calibration_reviews(train, params),
            ffn_width=int(arch["intermediate_size"]) if q.ffn_output_dynamic else None,
            cls_readout=bool(arch.get("cls_readout", False)), params=params, q=q, choice=choice,
            qat_choice=qat_precision, tmp=tmp)
        for name, build in BUILDERS.items():
            if name not in q.build:
                log.warning("%s skipped: %s", name, skipped)
                write_skipped(out[name], VariantInfo.skipped(name, skipped, to_dict(q)), finetuned)
                report[name] = {"status": "skipped", "reason": skipped}
                continue
            with building(out[name]) as work:
                t0 = time.perf_counter()
                report[name] = {**build(inputs, work), "build_seconds": round(time.perf_counter() - t0, 2)}
                write_variant(work, VariantInfo.built(name, report[name]), finetuned)
            if name in CHECKPOINT_JOBS:  # published: nothing left to resume (a kill before this resumes the QAT)
                CheckpointStore.for_job(params.train, CHECKPOINT_JOBS[name]).clear()
    return report


@contextlib.contextmanager
def scratch_directory(variants_root: Path, stage: str) -> Iterator[Path]:
    """A temporary directory for `stage`'s intermediate models, inside `variants_root` and removed afterwards.

    A model built there is moved into its variant directory with a rename (`_build_static`), which only works
    within one filesystem: from the system temporary directory (often a tmpfs) it fails with EXDEV (invalid
    cross-device link). Hidden (a leading dot), so nothing that lists the variants takes it for one. What a killed
    run of the same stage left there (no cleanup runs on SIGKILL) is removed first: runs of one stage in one
    checkout are not concurrent (DVC locks the repository), as for `stale_builds`."""
    variants_root.mkdir(parents=True, exist_ok=True)
    for stale in variants_root.glob(f".{stage}-*"):
        if stale.is_dir():
            log.info("removing %s, left by a %s run that was killed", stale, stage)
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".{stage}-", dir=variants_root) as tmp:
        yield Path(tmp)
