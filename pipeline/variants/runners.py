"""One way to run any variant: onnxruntime, TorchScript/eager and TensorRT runners behind one `Runner`
protocol, padding, and batched logits."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.variants.batch_invariance import Batching, scores_rows_alone
from pipeline.variants.record import VARIANT_FILE, VariantError, model_file, read_variant

log = logging.getLogger(__name__)

#: Why the project still calls a deprecated API, recorded in the fp32-torchscript variant and logged.
TORCHSCRIPT_DEPRECATION = (
    "TorchScript (torch.jit trace/load/freeze) is deprecated in the pinned PyTorch in favour of torch.export "
    "and torch.compile; fp32-torchscript is kept because the project's export formats name TorchScript, and its "
    "deprecation warnings are caught only around these calls (`legacy_torchscript`)"
)


@contextlib.contextmanager
def legacy_torchscript() -> Iterator[None]:
    """The one place the project calls deprecated API on purpose: torch.jit for the TorchScript variant.

    torch.jit's own DeprecationWarnings are caught here (and only here; anywhere else the test suite turns them
    into errors) and the reason is logged once per process."""
    if not getattr(legacy_torchscript, "logged", False):
        log.info("%s", TORCHSCRIPT_DEPRECATION)
        legacy_torchscript.logged = True  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        yield


class Runner(Protocol):
    """Anything that maps a padded batch of token ids to logits."""

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray: ...


def ort_session(path: Path, threads: int | None = None, optimization: str = "all") -> Any:
    """An onnxruntime CPU session with explicit graph optimisation level and thread count."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise VariantError(f"onnxruntime cannot load {path}: {exc}") from exc


class OrtRunner:
    """Runs an ONNX variant; feeds only the inputs the graph declares.

    A graph whose activation scales span the batch (`pipeline.variants.batch_invariance`) is run one review per
    call, each cut to its own attention mask, under `batching="auto"` (the default), so a review gets the same
    logits alone and in any batch; `batching="batched"` forces one call per batch (to measure what that costs)."""

    def __init__(self, path: Path, threads: int | None = None, optimization: str = "all",
                 batching: Batching = "auto") -> None:
        self.session = ort_session(path, threads, optimization)  # first: a file it cannot load is a VariantError
        self.rows_alone = scores_rows_alone(path, batching)
        self.inputs = {i.name for i in self.session.get_inputs()}

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)}
        return self.session.run(None, {k: v for k, v in feed.items() if k in self.inputs})[0]

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if not self.rows_alone or (len(input_ids) <= 1 and bool(np.all(attention_mask))):
            return self._run(input_ids, attention_mask)
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            keep = mask.astype(bool)
            if not keep.any():  # a fully masked row has no positions of its own: score it as given
                keep[:] = True
            rows.append(self._run(ids[keep][None, :], mask[keep][None, :]))
        return np.concatenate(rows, axis=0)


#: Autocast dtypes a `TorchRunner` can run under, by name.
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


class TorchRunner:
    """Runs an eager or TorchScript module under `inference_mode` (optionally under autocast, `AUTOCAST`) on the
    device its parameters live on (CPU for every variant; CUDA when a trained module is scored where it was trained
    or the distill stage's teacher labels reviews on the training GPU)."""

    def __init__(self, module: Any, autocast: str | None = None) -> None:
        import torch

        if autocast is not None and autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {sorted(AUTOCAST)} or None, not {autocast!r}")
        self.module = module
        self.autocast = autocast
        self.dtype = getattr(torch, AUTOCAST[autocast]) if autocast else None
        params = getattr(module, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        self.device = first.device if first is not None else torch.device("cpu")

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        import torch

        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device)
        mask = torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)).to(self.device)
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.dtype,
                                                     enabled=self.dtype is not None):
            out = self.module(ids, mask)
        logits = out[0] if isinstance(out, tuple | list) else getattr(out, "logits", out)
        return logits.float().cpu().numpy()


class EagerLogits:
    """Wraps a HF model so it is called positionally, like the traced/exported graphs."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, input_ids: Any, attention_mask: Any) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def parameters(self) -> Any:
        """The wrapped model's parameters (`TorchRunner` reads the device from them)."""
        return self.model.parameters()


def load_runner(directory: Path, threads: int | None = None, **options: Any) -> Runner:
    """A runner for any variant directory (or the finetuned HF directory as `fp32-eager`)."""
    directory = Path(directory)
    if not (directory / VARIANT_FILE).is_file() and (directory / "model.safetensors").is_file():
        from pipeline.modeling import load_finetuned

        model, _, _ = load_finetuned(directory)
        if options.get("cls_readout"):  # raises ReadoutError for a head that reads more than [CLS]
            from pipeline.variants.readout import cls_readout

            model = cls_readout(model)
        _set_threads(threads)
        return TorchRunner(EagerLogits(model), autocast=options.get("autocast"))
    info = read_variant(directory)
    if info.status != "ok":
        raise VariantError(f"variant {info.name} was {info.status}: {info.reason}")
    path = model_file(directory, info)
    if info.format == "onnx":
        return OrtRunner(path, threads, options.get("optimization", "all"), options.get("batching", "auto"))
    if info.format == "torchscript":
        import torch

        _set_threads(threads)
        with legacy_torchscript():
            module = torch.jit.load(str(path), map_location="cpu")
            module.eval()
            if options.get("freeze", True):
                module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
        return TorchRunner(module)
    if info.format == "tensorrt":
        from pipeline.variants.tensorrt import TensorRTRunner

        return TensorRTRunner(path)
    raise VariantError(f"unknown variant format {info.format!r} in {directory}")


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def pad_batch(seqs: Sequence[np.ndarray], pad_id: int = 0, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token-id arrays to the longest (or `width`) and build the attention mask."""
    w = width or max(len(s) for s in seqs)
    ids = np.full((len(seqs), w), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), w), dtype=np.int64)
    for i, s in enumerate(seqs):
        n = min(len(s), w)
        ids[i, :n] = s[:n]
        mask[i, :n] = 1
    return ids, mask


def predict_logits_on(model: Any, device: str, seqs: Sequence[np.ndarray], batch_size: int, pad_id: int,
                      autocast: str | None = None, progress: str | None = None) -> np.ndarray:
    """`predict_logits` of a HF model moved to `device` (under `autocast`, see `TorchRunner`); the model is back on
    the CPU afterwards, also when scoring fails, where the stages save, copy and export it."""
    model.to(device)
    try:
        return predict_logits(TorchRunner(EagerLogits(model), autocast=autocast), seqs, batch_size, pad_id, progress)
    finally:
        model.to("cpu")


def predict_logits(runner: Runner, seqs: Sequence[np.ndarray], batch_size: int = 64, pad_id: int = 0,
                   progress: str | None = None) -> np.ndarray:
    """Logits for token-id arrays in their original order, batched by length to save padding."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    out = np.zeros((len(seqs), 2), dtype=np.float32)
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=progress, unit="batch")
    for start in starts:
        idx = order[start : start + batch_size]
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id)
        out[idx] = runner(ids, mask)
    return out
