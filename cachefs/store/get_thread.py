"""First tries of many callers' small GETs on one thread of their own (a :class:`GetLoop`).

The mount's cold reads fetched each block on a thread of their own (the store's ordinary
``get_range``): with 16-32 GETs in flight, every socket call hands the GIL back and forth
between those threads and the FUSE loop. A cold 110 KB file cost the worker 44 voluntary
context switches (11 with this loop), and a perf profile of a cold-read pass put about half
of the worker's CPU in switching threads (``finish_task_switch``, futex waits and wake-ups;
bench/results/cold_read/2026-12-02-get-thread.md). Here one thread runs every first try in a
selector loop, as a preload fetcher process does (cachefs/store/get_loop.py): the requests
come in on a queue with a wake-up pipe, and each try's outcome goes to the callback given
with it, called on this thread.

A try the loop leaves *not done* (see :mod:`cachefs.store.get_loop`: a transient error, a
stall, anything unusual) reaches its callback as ``None``; so does every request while the
thread is not running, and every request still pending when it stops. The caller then reads
the range its ordinary way, with the retries, hedges and one-line errors of ``get_range``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

from cachefs.errors import StoreError
from cachefs.store.get_loop import GetLoop
from cachefs.store.s3_bulk import S3BulkReader

log = logging.getLogger(__name__)

#: A try's outcome as its callback gets it: the body (exactly the bytes asked), the store's
#: permanent error, or None (not done here: read it the ordinary way); and whether the store
#: answered "slow down".
Done = Callable[[bytearray | StoreError | None, bool], None]


class _Request(NamedTuple):
    reader: S3BulkReader
    key: str
    offset: int
    length: int
    etag: str | None
    done: Done


class LoopGets:
    """GETs in a :class:`GetLoop` on the thread that runs :meth:`run`, at most
    ``connections`` at once; :meth:`submit` and :meth:`stop` may be called from any thread."""

    def __init__(self, *, connections: int):
        self._connections = connections
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._lock = threading.Lock()  # _running, _stopping
        self._running = False
        self._stopping = False
        self._wake_read = self._wake_write = -1  # the wake-up pipe, open while it runs

    @property
    def running(self) -> bool:
        return self._running and not self._stopping

    def submit(
        self,
        reader: S3BulkReader,
        key: str,
        offset: int,
        length: int,
        etag: str | None,
        done: Done,
    ) -> None:
        """Start a try; ``done`` is called once with its outcome (on the loop's thread, or at
        once with None when the loop does not run)."""
        with self._lock:
            if self._running and not self._stopping:
                self._requests.put(_Request(reader, key, offset, length, etag, done))
                self._wake()
                return
        _call(done, None, False)

    def stop(self) -> None:
        """Make :meth:`run` return: every try still pending gets None first."""
        with self._lock:
            self._stopping = True
            if self._running:  # its pipe is open until it stops running
                self._wake()

    def run(self) -> None:
        """Blocking: serve the tries until :meth:`stop`; once only (the wake-up pipe is closed
        at the end)."""
        with self._lock:
            if self._stopping:
                return
            self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._running = True
        pending: dict[int, Done] = {}
        numbers = iter(range(1 << 62))
        try:
            with GetLoop(connections=self._connections) as loop:

                def take_requests() -> None:
                    try:
                        while os.read(self._wake_read, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    while True:
                        try:
                            request = self._requests.get_nowait()
                        except queue.Empty:
                            return
                        number = next(numbers)
                        try:
                            loop.submit(
                                number, request.reader, request.key, request.offset,
                                request.length, request.etag,
                            )  # fmt: skip
                        except Exception as exc:  # could not be signed: the ordinary read says why
                            log.debug("a GET of %r left to the ordinary path: %s", request.key, exc)
                            _call(request.done, None, False)
                            continue
                        pending[number] = request.done

                loop.watch(self._wake_read, take_requests)
                while not self._stopping:
                    for number, body, throttled in loop.poll():
                        _call(pending.pop(number), body, throttled)
        except Exception:  # a bug: every GET takes its thread from here on, and says so
            log.exception("the store GET loop stopped; GETs run on threads of their own now")
        finally:
            with self._lock:
                self._running = False
                self._stopping = True
            for done in pending.values():
                _call(done, None, False)
            while True:  # submitted after the last wake-up was read
                try:
                    _call(self._requests.get_nowait().done, None, False)
                except queue.Empty:
                    break
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is woken already


def _call(done: Done, body: bytearray | StoreError | None, throttled: bool) -> None:
    """A callback's failure is its own bug; it must not stop the loop for the others."""
    try:
        done(body, throttled)
    except Exception:
        log.exception("a GET's callback failed")
