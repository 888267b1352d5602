"""Server-side batching inside one process: concurrent callers' reviews scored together.

A server that answers each request in a thread of its own (MLflow's scoring app runs every `predict` in a worker
thread) would otherwise run one small forward pass per request, each competing for the same cores. `Coalescer`
does what TorchServe's frontend does across processes, with no thread of its own: a caller queues its token ids;
whichever caller finds the runner idle becomes the one that scores, takes everything queued (up to `max_texts`
texts, oldest first) as one batch, hands each caller its own slice of the answer and wakes them. A lone caller
scores at once and never waits for company.

A review's answer does not depend on its batch neighbours for every variant the pipeline serves batched (float
graphs and static INT8; `pipeline.runtimes.batch_invariance`), and variants with per-batch activation scales are
scored row by row by their runner anyway, so coalescing changes no answer. When a merged batch fails, each
caller's own reviews are scored alone, so a request that breaks the model fails only itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")

#: Most texts scored in one call of a runner: the coalesced batch of `Coalescer` and `SentimentPredictor`, and the
#: texts of queued requests the MLflow server hands to one `predict` (TorchServe's frontend batches by request).
MAX_BATCH_TEXTS = 64


def take_oldest(queue: list[T], size: Callable[[T], int], limit: int) -> list[T]:
    """Remove and return the oldest items of `queue` whose sizes fit `limit` together: a batch, always at least
    one item (one larger than `limit` goes alone). The MLflow server's request queue uses it too."""
    batch: list[T] = []
    total = 0
    while queue and (not batch or total + size(queue[0]) <= limit):
        batch.append(queue.pop(0))
        total += size(batch[-1])
    return batch


@dataclass(eq=False)
class _Job(Generic[R]):
    encoded: Sequence[np.ndarray]
    result: list[R] | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class Coalescer(Generic[R]):
    """Scores token-id sequences through `score` (one call, one batch; thread-safe to call from any number of
    threads), merging the sequences of callers that arrive while a batch is being scored."""

    score: Callable[[Sequence[np.ndarray]], list[R]]
    max_texts: int = MAX_BATCH_TEXTS
    _pending: list[_Job[R]] = field(default_factory=list, init=False, repr=False)
    _busy: bool = field(default=False, init=False, repr=False)
    _changed: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_texts < 1:
            raise ValueError(f"max_texts must be at least 1, not {self.max_texts}")

    def __call__(self, encoded: Sequence[np.ndarray]) -> list[R]:
        """`score(encoded)`'s answers, in order, possibly computed in one batch with other callers' sequences."""
        if not encoded:
            return []
        job: _Job[R] = _Job(encoded)
        with self._changed:
            self._pending.append(job)
            while True:
                while self._busy and not job.done:
                    self._changed.wait()
                if job.done:
                    break
                self._busy = True  # this caller scores the next batch (its own job or older ones first)
                batch = take_oldest(self._pending, lambda job: len(job.encoded), self.max_texts)
                self._changed.release()
                try:
                    self._run(batch)
                finally:
                    self._changed.acquire()
                    self._busy = False
                    self._changed.notify_all()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _run(self, batch: list[_Job[R]]) -> None:
        """Score `batch` in one call; if that fails, each job alone, so only the job at fault gets the error.
        Every job of the batch ends done, with a result or an error, whatever happens here."""
        try:
            self._score_batch(batch)
        finally:
            for job in batch:
                if job.result is None and job.error is None:
                    job.error = RuntimeError("scoring was interrupted before this request's batch finished")
                job.done = True

    def _score_batch(self, batch: list[_Job[R]]) -> None:
        sizes = [len(job.encoded) for job in batch]
        try:
            answers = self.score([ids for job in batch for ids in job.encoded])
            if len(answers) != sum(sizes):
                raise RuntimeError(f"scorer returned {len(answers)} answers for {sum(sizes)} sequences")
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
                return
            # the batch's error is logged here: if each job then scores alone, nothing else would show it
            log.warning("a merged batch of %d calls (%d sequences) failed, scoring each alone: %s", len(batch),
                        sum(sizes), exc, exc_info=exc)
            for job in batch:
                try:
                    job.result = list(self.score(job.encoded))
                except Exception as own:
                    job.error = own
            return
        start = 0
        for job, size in zip(batch, sizes, strict=True):
            job.result = list(answers[start : start + size])
            start += size
