"""Per-call ownership of what a runtime cannot share between threads.

onnxruntime's `InferenceSession.run` and a PyTorch module under `inference_mode` may be called from many threads
at once; an OpenVINO `InferRequest` and a TensorRT execution context may not (OpenVINO answers a second caller
with "Infer Request is busy"; a TensorRT context holds its input shapes and tensor addresses). A runner keeps
such objects in a `Pool`: each call borrows one that no other call holds, creating it when every existing one is
busy, and gives it back when done, so the pool grows to the highest number of concurrent calls and no further.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Pool(Generic[T]):
    """Objects made by `factory`, each lent to one caller at a time (`borrow`); thread-safe.

    `limit` (None: unbounded) caps how many exist: a caller beyond it waits for one to come back. Objects are
    kept for reuse; the pool never drops one (a runner's requests live as long as the runner)."""

    def __init__(self, factory: Callable[[], T], limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1 or None, not {limit}")
        self._factory = factory
        self._limit = limit
        self._idle: list[T] = []
        self._created = 0
        self._available = threading.Condition()

    @property
    def created(self) -> int:
        """How many objects the pool has made (the most that were ever in use at once, or `limit`)."""
        return self._created

    @contextlib.contextmanager
    def borrow(self) -> Iterator[T]:
        """An object no other caller holds until this block ends (a new one when all are busy and the limit
        allows, else the first one given back)."""
        item = self._take()
        try:
            yield item
        finally:
            with self._available:
                self._idle.append(item)
                self._available.notify()

    def _take(self) -> T:
        with self._available:
            while not self._idle and self._limit is not None and self._created >= self._limit:
                self._available.wait()
            if self._idle:
                return self._idle.pop()
            self._created += 1  # counted before the (possibly slow) factory runs, so the limit holds meanwhile
        try:
            return self._factory()
        except BaseException:
            with self._available:
                self._created -= 1
                self._available.notify()
            raise
