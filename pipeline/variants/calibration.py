"""Calibration for static INT8: the training reviews every static build calibrates on, in batches without padding,
the onnxruntime data reader that feeds them, and the calibration options shared by every QDQ build."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.params import Params, QuantizeParams

if TYPE_CHECKING:
    import pandas as pd

#: The calibration methods onnxruntime's static quantizer offers here.
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")


def unpadded_batches(seqs: Sequence[np.ndarray], batch_size: int) -> list[list[np.ndarray]]:
    """`seqs` in batches of at most `batch_size` reviews of one token length each, shortest first.

    A padded position's activations (a [PAD] token attending to the review) never reach an answer: attention masks
    it as a key and the readout skips it. Observed by a calibrator, they would still widen or shift the ranges the
    real tokens are quantized with. Batches of equal lengths hold no padding: every activation a calibrator sees
    is a real token's. Reviews cut at `data.max_length` share one length and batch together; shorter ones mostly
    go alone."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    by_length: dict[int, list[np.ndarray]] = {}
    for seq in sorted(seqs, key=len):
        by_length.setdefault(len(seq), []).append(np.asarray(seq, dtype=np.int64))
    return [same[b : b + batch_size] for same in by_length.values() for b in range(0, len(same), batch_size)]


class TokenCalibrationReader:
    """onnxruntime `CalibrationDataReader` over real reviews in batches without padding (`unpadded_batches`).

    Batches differ in length, and onnxruntime's histogram calibrators (percentile, entropy) stack what one
    `collect_data` call observed into one array: the reader is sliced one batch per call (`__len__` and
    `set_range`, which `quantize_static` uses under `CalibStridedMinMax`, see `calibration_options`, and
    `collect_by_batch` for a calibrator driven directly), and the calibrators merge the batches' ranges and
    histograms."""

    def __init__(self, seqs: Sequence[np.ndarray], batch_size: int, input_names: set[str]) -> None:
        self.batches = unpadded_batches(seqs, batch_size)
        self.input_names = input_names
        self.start, self.end = 0, len(self.batches)
        self._it: Iterator[list[np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end = start_index, end_index
        self._it = None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = iter(self.batches[self.start : self.end])
        batch = next(self._it, None)
        if batch is None:
            return None
        ids = np.stack(batch)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        return {k: v for k, v in feed.items() if k in self.input_names}

    def rewind(self) -> None:
        self.set_range(0, len(self.batches))


def collect_by_batch(calibrator: Any, reader: TokenCalibrationReader) -> None:
    """Feed `reader` to an onnxruntime calibrator one batch per `collect_data` call, as `quantize_static` does
    under `CalibStridedMinMax` = 1."""
    for start in range(len(reader)):
        reader.set_range(start, start + 1)
        calibrator.collect_data(reader)


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
    float, the percentile from params, the reader collected one batch at a time; activations asymmetric uint8 for
    onnxruntime, symmetric for TensorRT."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod

    # CalibStridedMinMax: despite its name, quantize_static's option for any calibrator to collect the reader in
    # slices; one batch per slice, as batches without padding differ in length (`TokenCalibrationReader`)
    extra: dict[str, Any] = {"ActivationSymmetric": activation_symmetric, "WeightSymmetric": True,
                             "QuantizeBias": False, "DefaultTensorType": onnx.TensorProto.FLOAT,
                             "CalibStridedMinMax": 1}
    if method == "percentile":
        extra["CalibPercentile"] = params.calibration_percentile
    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    return {"calibrate_method": methods[method], "extra_options": extra}
