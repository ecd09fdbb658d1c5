"""The replay queue: fair across runs (issue 20, item 7).

Captures to replay (or whose in-process verdict is awaited) are queued per run and taken round
robin, one per run in turn, so a run that floods the queue (thousands of junk captures) delays
another run's verdict by at most one replay per flooding run, not by its whole backlog. Within a
run the order is the order offered (oldest capture first).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from typing import Generic, Hashable, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    """A thread-safe queue of ``(key, item)`` taken round robin over keys (the run).

    The subset of :class:`queue.Queue` the replay thread uses: :meth:`put` and :meth:`get`
    (which raises :class:`queue.Empty` after ``timeout`` seconds).
    """

    def __init__(self) -> None:
        self._runs: OrderedDict[Hashable, deque[T]] = OrderedDict()
        self._cond = threading.Condition()

    def put(self, key: Hashable, item: T) -> None:
        """Queue ``item`` behind the other items of run ``key``."""
        with self._cond:
            self._runs.setdefault(key, deque()).append(item)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> T:
        """The oldest item of the run whose turn it is; that run then goes to the back.

        Raises:
            queue.Empty: nothing came within ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._runs), timeout):
                raise queue.Empty
            key, items = next(iter(self._runs.items()))
            item = items.popleft()
            del self._runs[key]
            if items:
                self._runs[key] = items  # to the back: every other run goes first
            return item

    def qsize(self) -> int:
        """Items queued over all runs."""
        with self._cond:
            return sum(len(v) for v in self._runs.values())
