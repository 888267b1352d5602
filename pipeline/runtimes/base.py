"""The interface every runtime implements (`Runtime`: load from a variant directory, logits for a padded batch,
a description of its settings), padding, and batched logits for token-id arrays in their original order."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from pipeline.runtimes.record import VariantError, VariantInfo


class Runner(Protocol):
    """Anything that maps a padded batch of token ids to logits."""

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray: ...


class Runtime(Runner, Protocol):
    """A runtime of one variant format (`pipeline.runtimes.catalog.Format`): built from a variant directory by
    `load`, it maps padded batches to logits and says what it runs with (`describe`)."""

    format: ClassVar[str]

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> Runtime:
        """The runtime of the variant in `directory` (`info` is its record; None for the finetuned HF directory)
        with `threads` intra-op threads (None: the library's default) and format-specific `options`."""
        ...

    def describe(self) -> dict[str, Any]:
        """The runtime's name and the settings it runs with (threads, optimisation, batching, ...)."""
        ...


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


def length_order(seqs: Sequence[np.ndarray]) -> np.ndarray:
    """The indices of `seqs` from shortest to longest, reviews of one length in their given order (a stable sort:
    numpy's default sort orders ties differently across versions and CPUs, and the batches, so the calibration
    ranges and padded shapes built from them, would follow)."""
    return np.argsort([len(s) for s in seqs], kind="stable")


def length_sorted_batches(seqs: Sequence[np.ndarray], *, batch_size: int,
                          pad_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`seqs` sorted by length (ties keep their order) in batches of `batch_size`, each padded to its own longest
    (`pad_batch`): the calibration passes' batches, little padding to run."""
    order = length_order(seqs)
    return [pad_batch([seqs[i] for i in order[b : b + batch_size]], pad_id) for b in range(0, len(order), batch_size)]


def predict_logits(runner: Runner, seqs: Sequence[np.ndarray], batch_size: int = 64, pad_id: int = 0,
                   progress: str | None = None, callers: int = 1) -> np.ndarray:
    """Logits for token-id arrays in their original order, batched by length to save padding.

    `callers` > 1: that many threads call `runner` at once, each on its own batches (a runner must be safe to call
    concurrently, as every runtime here is). Each batch is scored by exactly one call, so the logits are those of
    one caller; only the wall time changes."""
    order = length_order(seqs)
    out = np.zeros((len(seqs), 2), dtype=np.float32)
    starts = list(range(0, len(order), batch_size))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(starts), desc=progress, unit="batch")

    def score(start: int) -> None:
        idx = order[start : start + batch_size]
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id)
        out[idx] = runner(ids, mask)  # disjoint rows per batch: no two calls write the same row
        if bar is not None:
            bar.update(1)

    try:
        if callers > 1 and len(starts) > 1:
            _score_concurrently(score, starts, callers)
        else:
            for start in starts:
                score(start)
    finally:
        if bar is not None:
            bar.close()
    return out


def _score_concurrently(score: Callable[[int], None], starts: Sequence[int], callers: int) -> None:
    """`score` of every batch start on `callers` threads. The first failed call's exception is raised as soon as it
    happens, and no batch starts once the failure is marked, which the failing thread does itself before it takes
    another batch: a runner that fails on every batch (a variant that cannot run these inputs) is called once per
    thread (the failed call and those already under way on the others), however late this thread sees the
    failure; only a thread that ends a call in the instant between the failure and its mark can start one more."""
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    failed = threading.Event()

    def score_unless_failed(start: int) -> None:
        if failed.is_set():
            return
        try:
            score(start)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max_workers=callers, thread_name_prefix="score") as pool:
        futures = [pool.submit(score_unless_failed, start) for start in starts]
        try:
            for done in as_completed(futures):
                done.result()  # re-raises a failed call's exception here
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # the calls under way finish; the queued ones never start
            raise


def checked_options(runtime: str, options: Mapping[str, Any],
                    allowed: Mapping[str, tuple[Any, ...] | None]) -> dict[str, Any]:
    """`options` given to `runtime`'s `load`, each key one of `allowed` and each value one of the values it lists
    (`None` in `allowed`: a value the runtime checks itself, such as a count); anything else is a `VariantError`
    naming what the runtime accepts (a misspelt option would otherwise be ignored and the default measured or
    served in its place)."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = ", ".join(f"{k} ({' | '.join(map(repr, v)) if v is not None else 'checked by the runtime'})"
                             for k, v in allowed.items()) or "none"
        raise VariantError(f"the {runtime} runtime has no option {', '.join(map(repr, unknown))}; "
                           f"its options: {accepted}")
    for key, value in options.items():
        values = allowed[key]
        if values is not None and not any(value is v or (type(value) is type(v) and value == v) for v in values):
            raise VariantError(f"the {runtime} runtime's option {key}={value!r} is not one of "
                               f"{', '.join(map(repr, values))}")
    return dict(options)


def set_torch_threads(threads: int | None) -> None:
    """PyTorch's intra-op thread count, when one is given (None keeps the library's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
