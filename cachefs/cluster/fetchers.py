"""Bulk fetching for the preloader, spread over several processes.

An SDK GET costs about 1.4 ms of client CPU (boto3), so one Python process tops out near 700
GETs/s per core — and the worker process must keep its core for FUSE. Preload fetches run in a
pool of helper processes instead; each opens its own store client once per dataset and sends
the block's bytes back through the pool's pipe. Admission (index + tier files) stays in the
worker, which owns the cache.

The pool starts its processes with ``forkserver``: forking the worker itself (threads, a FUSE
session) would copy locks held by other threads. ``processes=0`` fetches in the calling thread
instead (no extra processes; for small machines and tests).

Each fetcher exits when the worker that owns the pool does, however it ends: a pool worker
blocks on a queue whose write end it holds itself, and holds the forkserver's "alive" pipe, so
after a SIGKILL of the worker (an OOM kill) neither would ever see EOF — they ran on forever.
They ignore SIGINT: Ctrl-C in a terminal reaches every process of the foreground group, and the
worker, which handles it, stops its fetchers itself (a fetcher interrupted mid-GET would only
print a traceback).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from cachefs.errors import CachefsError, StoreError
from cachefs.store import StoreConfig, open_store

_stores: dict[StoreConfig, object] = {}  # per process: one store client per dataset source


def _store(config: StoreConfig):
    store = _stores.get(config)
    if store is None:
        store = _stores[config] = open_store(config)
    return store


def fetch_range(config: StoreConfig, key: str, offset: int, length: int, etag: str):
    """Runs in a pool process. Returns the bytes, or ("error", message): exceptions of ours
    carry keyword-only constructor arguments that do not survive pickling."""
    try:
        return _store(config).get_range(key, offset, length, etag=etag)
    except CachefsError as exc:
        return ("error", str(exc))


def exit_with(owner: int) -> None:
    """Runs first in each pool process: SIGINT is ignored (the owner stops us), and a daemon
    thread ends the process when ``owner`` (the worker's pid, alive when this runs) exits. A
    pidfd names that very process (no pid reuse); where there is none (Linux < 5.3), the pid is
    polled once a second."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        try:
            owner_fd = os.pidfd_open(owner)
        except ProcessLookupError:
            os._exit(0)
        except (AttributeError, OSError):
            while True:
                time.sleep(1.0)
                try:
                    os.kill(owner, 0)
                except ProcessLookupError:
                    os._exit(0)
        select.select([owner_fd], [], [])  # readable once the owner has exited
        os._exit(0)

    threading.Thread(target=watch, name="cachefs-fetcher-owner", daemon=True).start()


class FetchFailed(StoreError):
    pass


class FetcherPool:
    def __init__(self, processes: int):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # many preload threads call fetch(): one pool only

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes,
                    mp_context=multiprocessing.get_context("forkserver"),
                    initializer=exit_with,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def fetch(self, config: StoreConfig, key: str, offset: int, length: int, etag: str) -> bytes:
        """Blocking: call from a thread. Raises StoreError (FetchFailed) with the reason."""
        if self.processes <= 0:
            result = fetch_range(config, key, offset, length, etag)
        else:
            result = (
                self._executor().submit(fetch_range, config, key, offset, length, etag).result()
            )
        if isinstance(result, tuple):
            raise FetchFailed(result[1])
        if len(result) != length:  # never admit a short read
            raise FetchFailed(f"got {len(result)} bytes for a {length}-byte range of {key!r}")
        return result

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for store in _stores.values():
            store.close()
        _stores.clear()
