"""Background prefetch: a thread runs an iterator ahead of its consumer.

Starting it early lets the data pipeline warm up (open files, decode the first batches) while
the trainer does other work (restore, compile); `next()` then returns ready batches. An error
in the producer is raised in the consumer, at the point in the stream where it happened.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Iterates `source` in a daemon thread, keeping up to `depth` items ready. `found_ready`
    tells whether the last `next()` found an item waiting (False: it waited for the source)."""

    def __init__(self, source: Iterable[T], *, depth: int = 2, name: str = "ettflow-prefetch"):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth must be >= 1, got {depth}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.found_ready = False  # whether the last `next()` found an item waiting
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(_Raised(e))
            return
        self._put(_END)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        try:
            item = self._queue.get_nowait()
            self.found_ready = True
        except queue.Empty:
            self.found_ready = False
            item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.error
        return item  # type: ignore[return-value]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (it finishes the item it is making) and drop what is queued."""
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def found_ready(it: object) -> bool:
    """Whether the last item taken from `it` was waiting, made ahead (only a Prefetcher's are)."""
    return isinstance(it, Prefetcher) and it.found_ready
