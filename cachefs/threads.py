"""Threads started on demand to run queued work items: lighter than a ThreadPoolExecutor.

Used by the store's hedged reads (cachefs/store/retry.py: each try of a GET) and by the
preload's fetcher processes (cachefs/cluster/fetchers.py: each request on the pipe). No Future
and no done-callback per item, one queue put to hand it over: a hedged read whose try returns
at once cost 73 us of CPU with a ThreadPoolExecutor, 39 us with this (bench/README.md, "Where a
cold small file's worker CPU goes").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class LazyThreads:
    """A queue of work items and up to ``limit`` threads that take them, started when an item
    finds none idle and kept after. Each thread calls ``run(*item)``, which must not raise.

    Every item put on the queue is claimed when it is put: by an idle thread, by a thread
    started for it, or, when ``limit`` threads are all busy, by the next thread to finish
    (``_unclaimed``), so an item never waits while a thread idles. Threads are daemons (named
    ``<name>_<n>``): an item stuck in a silent socket must not hold up the process's exit.
    """

    def __init__(
        self,
        limit: int,
        name: str,
        run: Callable[..., None],
        dropped: Callable[[], None] | None = None,
    ):
        self._limit = limit
        self._name = name
        self._run = run
        self._dropped = dropped  # called once for every item close() takes off the queue
        self._items: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()  # None: stop
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting on the queue, not claimed by an item yet
        self._unclaimed = 0  # items queued while every thread was busy
        self._closed = False

    def submit(self, item: tuple[Any, ...]) -> None:
        """Queue an item; RuntimeError once :meth:`close` was called."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} threads are closed")
            start = None
            if self._idle:
                self._idle -= 1
            elif self._threads < self._limit:
                self._threads += 1
                start = f"{self._name}_{self._threads}"
            else:
                self._unclaimed += 1
            self._items.put(item)
        if start is not None:
            threading.Thread(target=self._serve, name=start, daemon=True).start()

    def close(self) -> None:
        """Take the items not begun off the queue (each one ``dropped``) and let every thread
        end once its item has ended."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is not None and self._dropped is not None:
                self._dropped()
        for _ in range(threads):
            self._items.put(None)

    def _serve(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            self._run(*item)
            del item  # its result may be large: not kept while this thread idles
            with self._lock:
                if self._unclaimed:
                    self._unclaimed -= 1
                else:
                    self._idle += 1
