"""`int8-openvino`: the fp32-onnx graph read by OpenVINO and quantized by NNCF's post-training quantization
(transformer preset: static INT8 activation scales calibrated once, on the same training reviews int8-static
calibrates on), saved as OpenVINO IR (`model.xml` + `model.bin`) for `pipeline.runtimes.openvino`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtimes.base import pad_batch
from pipeline.variants.onnx_int8 import QuantizeError


def quantize_openvino(fp32_onnx: Path, calibration: list[np.ndarray], pad_id: int, batch_size: int,
                      out_dir: Path) -> dict[str, Any]:
    """Write `out_dir/model.xml` (+ `.bin`) and return what the variant record says of the build. The calibration
    reviews go in length-sorted batches of `batch_size`, each padded to its own longest review."""
    try:
        import nncf
        import openvino as ov
    except ImportError as exc:
        raise QuantizeError(f"int8-openvino needs openvino and nncf (requirements.txt): {exc}") from exc
    if not calibration:
        raise QuantizeError("int8-openvino needs calibration reviews (quantize.calibration_samples > 0)")
    t0 = time.perf_counter()
    model = ov.convert_model(str(fp32_onnx))
    names = {p.get_any_name() for p in model.inputs}
    order = np.argsort([len(s) for s in calibration], kind="stable")
    batches = [pad_batch([calibration[i] for i in order[b : b + batch_size]], pad_id)
               for b in range(0, len(order), batch_size)]

    def feed(batch: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in zip(("input_ids", "attention_mask"), batch, strict=True) if k in names}

    quantized = nncf.quantize(model, nncf.Dataset(batches, feed), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(batches))  # NNCF counts dataset items: batches
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out_dir / "model.xml"), compress_to_fp16=False)
    return {"method": "nncf.quantize (OpenVINO IR, model_type=TRANSFORMER)", "source": "fp32-onnx",
            "calibration_samples": len(calibration), "calibration_batches": len(batches),
            "versions": {"openvino": ov.__version__, "nncf": nncf.__version__},
            "build_seconds": round(time.perf_counter() - t0, 2)}
