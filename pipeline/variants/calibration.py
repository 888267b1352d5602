"""Calibration for static INT8: the training reviews every static build calibrates on, the onnxruntime data
reader that feeds them in length-sorted batches, and the calibration options shared by every QDQ build."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.params import Params, QuantizeParams
from pipeline.runtimes.base import length_order, pad_batch

if TYPE_CHECKING:
    import pandas as pd

class TokenCalibrationReader:
    """onnxruntime `CalibrationDataReader` over real, length-sorted review batches (`length_order`, the order every
    length-sorted pass uses), all padded to the longest review."""

    def __init__(self, seqs: Sequence[np.ndarray], batch_size: int, input_names: set[str], pad_id: int = 0) -> None:
        order = length_order(seqs)
        self.batches = [[seqs[i] for i in order[b : b + batch_size]] for b in range(0, len(order), batch_size)]
        self.input_names = input_names
        self.pad_id = pad_id
        # One width for all batches: histogram calibrators (percentile, entropy) stack them.
        self.width = max((len(s) for s in seqs), default=1)
        self._it: Iterator[list[np.ndarray]] | None = None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = iter(self.batches)
        batch = next(self._it, None)
        if batch is None:
            return None
        ids, mask = pad_batch(batch, self.pad_id, self.width)
        feed = {"input_ids": ids, "attention_mask": mask}
        return {k: v for k, v in feed.items() if k in self.input_names}

    def rewind(self) -> None:
        self._it = None


def calibration_reviews(train: pd.DataFrame, params: Params) -> list[np.ndarray]:
    """The training reviews every static INT8 build calibrates on: `quantize.calibration_samples` of them,
    drawn with `train.seed` (the TensorRT INT8 input is calibrated on the same ones)."""
    from pipeline.data.tokens import draw_rows

    rows = draw_rows(len(train), params.quantize.calibration_samples, params.train.seed)
    return [train["input_ids"].iloc[i] for i in rows]


def calibration_options(method: str, params: QuantizeParams, activation_symmetric: bool) -> dict[str, Any]:
    """`quantize_static`'s calibration method and extra options shared by every QDQ build: symmetric
    per-channel weights, float biases (int32 bias scales need a calibrated input scale, which sliced inputs such
    as the pooler's [CLS] `select` do not get, and float biases cost nothing measurable), fused contrib ops typed
    float, the percentile from params; activations asymmetric uint8 for onnxruntime, symmetric for TensorRT."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod

    extra: dict[str, Any] = {"ActivationSymmetric": activation_symmetric, "WeightSymmetric": True,
                             "QuantizeBias": False, "DefaultTensorType": onnx.TensorProto.FLOAT}
    if method == "percentile":
        extra["CalibPercentile"] = params.calibration_percentile
    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    return {"calibrate_method": methods[method], "extra_options": extra}
