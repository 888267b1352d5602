"""`int8-openvino`: the finetuned model as it is exported (with the [CLS] readout where `export.cls_readout` asks for
it), captured by `torch.export` with dynamic batch and length, read by OpenVINO's PyTorch frontend and quantized by
NNCF's post-training quantization (transformer preset: static INT8 activation scales calibrated once, on the same
training reviews int8-static calibrates on), saved as OpenVINO IR (`model.xml` + `model.bin`) for
`pipeline.runtimes.openvino`.

The PyTorch frontend, not the fp32-onnx file, is the source: PyTorch's `sdpa` attention reaches OpenVINO as its
fused `ScaledDotProductAttention` op, while the ONNX graph's attention arrives as separate MatMuls and a Softmax
and runs slower (docs/peers.md has the measurement)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtimes.base import length_sorted_batches
from pipeline.runtimes.eager import logits_module
from pipeline.runtimes.openvino import compiled_model, inference_precision
from pipeline.variants.onnx_int8 import QuantizeError


def openvino_model(model: Any, example: tuple[np.ndarray, np.ndarray]) -> Any:
    """An OpenVINO model of `model` (a Hugging Face classifier, eval mode) through `torch.export`, batch and length
    dynamic (up to the model's position table). `example` is one padded batch; it is repeated to two rows so that
    the batch dimension is not specialised to 1.

    A copy of `model` is exported with PyTorch's `scaled_dot_product_attention`, which OpenVINO reads as its fused
    `ScaledDotProductAttention` op; eager attention (which the int8-dynamic build leaves the model in, see
    `pipeline.variants.fusion.fused_graph`) reaches OpenVINO as separate MatMuls and a Softmax, and runs slower."""
    import openvino as ov
    import torch

    model = sdpa_copy(model)
    ids, mask = two_row_example(example)
    dims = {0: torch.export.Dim("batch"),
            1: torch.export.Dim("tokens", max=int(model.config.max_position_embeddings))}
    with torch.no_grad():
        exported = torch.export.export(logits_module(model), (ids, mask),
                                       dynamic_shapes={"input_ids": dims, "attention_mask": dims})
    return ov.convert_model(exported)


def two_row_example(example: tuple[np.ndarray, np.ndarray]) -> tuple[Any, Any]:
    """`example` (one padded batch) repeated to two rows, as int64 tensors: a conversion traced or exported with it
    does not specialise the batch dimension to 1."""
    import torch

    return tuple(torch.from_numpy(np.repeat(np.asarray(a, dtype=np.int64), 2, axis=0))  # type: ignore[return-value]
                 for a in example)


def sdpa_copy(model: Any) -> Any:
    """A copy of `model` (a Hugging Face classifier) with PyTorch's `scaled_dot_product_attention`, the form
    OpenVINO reads as its fused `ScaledDotProductAttention` op."""
    import copy

    model = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    return model


def calibration_batches(calibration: list[np.ndarray], *, pad_id: int,
                        batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The calibration reviews in length-sorted batches of `batch_size`, each padded to its own longest review
    (NNCF counts dataset items: one item is one batch)."""
    if not calibration:
        raise QuantizeError("OpenVINO INT8 needs calibration reviews (quantize.calibration_samples > 0)")
    return length_sorted_batches(calibration, batch_size=batch_size, pad_id=pad_id)


def quantize_openvino(model: Any, calibration: list[np.ndarray], pad_id: int, batch_size: int,
                      out_dir: Path) -> dict[str, Any]:
    """Write `out_dir/model.xml` (+ `.bin`) from `model` (the inference graph, `pipeline.variants.export.
    inference_model`) and return what the variant record says of the build. The calibration reviews go in
    length-sorted batches of `batch_size`, each padded to its own longest review."""
    try:
        import nncf
        import openvino  # noqa: F401  (save_openvino and the conversion need it: say so up front)
    except ImportError as exc:
        raise QuantizeError(f"int8-openvino needs openvino and nncf (requirements.txt): {exc}") from exc
    batches = calibration_batches(calibration, pad_id=pad_id, batch_size=batch_size)
    converted = openvino_model(model, batches[-1])
    names = {p.get_any_name() for p in converted.inputs}

    def feed(batch: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in zip(("input_ids", "attention_mask"), batch, strict=True) if k in names}

    quantized = nncf.quantize(converted, nncf.Dataset(batches, feed), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(batches))  # NNCF counts dataset items: batches
    return {"method": "nncf.quantize (OpenVINO IR, model_type=TRANSFORMER)", **save_openvino(quantized, out_dir),
            "source": "torch.export of the finetuned model (OpenVINO's PyTorch frontend)",
            "calibration_samples": len(calibration), "calibration_batches": len(batches)}


def save_openvino(model: Any, out_dir: Path) -> dict[str, Any]:
    """Write `out_dir/model.xml` (+ `.bin`) and return what a variant record says of it: the precision it compiles
    to here and the versions that built it (int8-openvino's and int8-qat-openvino's records)."""
    import nncf
    import openvino as ov

    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_dir / "model.xml"), compress_to_fp16=False)
    # The CPU plugin picks the float layers' precision itself (bf16 where the CPU has native bf16, else f32; no
    # hint is set, so results stay as measured): the record says what the saved IR compiles to on the build CPU,
    # compiled as `OpenVinoRunner` compiles it. Another CPU may differ; the evaluate stage records its own
    # (`scored_with`, from `OpenVinoRunner.describe`).
    return {"inference_precision_on_build_cpu": inference_precision(compiled_model(out_dir / "model.xml")),
            "versions": {"openvino": ov.__version__, "nncf": nncf.__version__}}
