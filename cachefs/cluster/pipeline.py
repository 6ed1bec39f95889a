"""The preload's fetch pipeline: blocks from the store into the cache, many GETs in flight,
driven by one thread.

The preload is bound by the worker's CPU, not by the store: with a trio task per object and a
thread hop per block (fetch, wait, admit), the worker spent ~1.9 ms of CPU per block and a
local store answered 4-8 times faster than that (bench/results/store_fetch_rate). Here one
thread runs a whole set of shards: it starts each block's GET on the
:class:`~cachefs.cluster.fetchers.FetcherPool` without waiting (a future), keeps as many in
flight as the node's adaptive limit allows (:class:`~cachefs.store.concurrency.ThreadedConcurrency`,
shared by every pipeline of the node), and admits each answer as it comes in — the fetchers'
answer threads only put it on this pipeline's queue. No trio task, no thread hop per block; the
trio side starts the thread, stops it, and reads the progress.

Per block, in plan order: a block already cached is verified (a full read checks its checksums)
and skipped; for the others the cache reserves room (:meth:`BlockCache.reserve`), a fetcher
process GETs the block and writes it straight into the reservation's file with its checksums,
and this thread admits that file (a rename and an index entry): a block's bytes never pass
through the worker process. The first block of an object that fails marks the object failed
with the reason (its other blocks are not asked for); an object is done when every selected
block is cached. Stopping (the job cancelled, the shard handed away) returns within
:data:`STOP_POLL_S`: answers still on their way are dropped, their room in the cache and their
places under the limit given back.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from cachefs.cache.base import BlockCache, BlockKey, Reservation
from cachefs.errors import CachefsError
from cachefs.store import StoreConfig
from cachefs.store.concurrency import ThreadedConcurrency

from .fetchers import FetcherPool, FetchFailed, Written
from .planning import PlannedObject

MAX_FAILURES_LISTED = 20  # per shard; the count is exact
#: How often a pipeline waiting for answers (or a place under the limit) looks at its stop flag.
STOP_POLL_S = 0.2


@dataclass
class ShardProgress:
    """One shard's progress in a job: written by its pipeline thread, read by the heartbeat."""

    objects: int = 0
    bytes: int = 0
    done_objects: int = 0
    done_bytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    failed_count: int = 0
    complete: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def done(self, obj: PlannedObject) -> None:
        with self._lock:
            self.done_objects += 1
            self.done_bytes += obj.selected_bytes

    def fail(self, key: str, reason: str) -> None:
        with self._lock:
            self.failed_count += 1
            if len(self.failed) < MAX_FAILURES_LISTED:
                self.failed[key] = reason

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {
                "objects": self.objects,
                "bytes": self.bytes,
                "done_objects": self.done_objects,
                "done_bytes": self.done_bytes,
                "failed": dict(self.failed),
                "failed_count": self.failed_count,
                "complete": self.complete,
            }


@dataclass(frozen=True, slots=True)
class BlockSource:
    """Where a dataset's blocks come from and how they are keyed in the cache."""

    config: StoreConfig
    source_id: int
    block_size: int


class FetchCounters:
    """The node's preload fetch totals (status document, metrics), summed over its pipelines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blocks = 0
        self.bytes = 0
        self.failures = 0
        self._gets: dict[str, int] = {}  # GETs answered, by outcome: "ok" or the error's kind

    def add(self, *, blocks: int = 0, nbytes: int = 0, failures: int = 0) -> None:
        with self._lock:
            self.blocks += blocks
            self.bytes += nbytes
            self.failures += failures

    def got(self, outcome: str) -> None:
        with self._lock:
            self._gets[outcome] = self._gets.get(outcome, 0) + 1

    def gets(self) -> dict[str, int]:
        """Store GETs the preload's fetchers made, by outcome (cachefs_store_requests)."""
        with self._lock:
            return dict(self._gets)


class _ObjectRun:
    """An object on its way through the pipeline."""

    __slots__ = ("failed", "finished", "obj", "outstanding", "progress", "submitted")

    def __init__(self, obj: PlannedObject, progress: ShardProgress):
        self.obj = obj
        self.progress = progress
        self.outstanding = 0  # its GETs not yet admitted
        self.submitted = False  # every block it needs was asked for (or found cached)
        self.failed = False
        self.finished = False  # counted done or failed


@dataclass(frozen=True, slots=True)
class _Answer:
    run: _ObjectRun
    reservation: Reservation
    future: Future[Written]


class _Started(NamedTuple):
    future: Future[Written]
    reservation: Reservation


class NotAdmitted(CachefsError):
    """The cache has no room for a block (avoid-eviction and full)."""


class _Inbox:
    """Where the fetchers' answer threads hand answers to the pipeline. Once closed (the
    pipeline stopped), an answer that arrives gives its reservation back instead: its room and
    its file must not outlive the pipeline."""

    def __init__(self, cache: BlockCache):
        self._cache = cache
        self._answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def deliver(self, run: _ObjectRun, reservation: Reservation, future: Future[Written]) -> None:
        """A GET's done-callback (on a fetcher's answer thread)."""
        with self._lock:
            if not self._closed:
                self._answers.put(_Answer(run, reservation, future))
                return
        self._cache.abandon(reservation)

    def next(self, wait_s: float = 0.0) -> _Answer | None:
        """The next answer, waiting up to ``wait_s`` seconds for one (0: not at all); None if
        there is none."""
        try:
            if wait_s > 0:
                return self._answers.get(timeout=wait_s)
            return self._answers.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """No more answers are taken: those waiting give their reservations back now, later
        ones as they arrive."""
        with self._lock:
            self._closed = True
        while (answer := self.next()) is not None:
            self._cache.abandon(answer.reservation)


class FetchPipeline:
    """Fetches and admits the blocks of planned objects (see the module docstring). One
    :meth:`run` per thread; the cache, pool, limit and counters are the node's, shared."""

    def __init__(
        self,
        cache: BlockCache,
        pool: FetcherPool,
        concurrency: ThreadedConcurrency,
        counters: FetchCounters,
    ):
        self._cache = cache
        self._pool = pool
        self._concurrency = concurrency
        self._counters = counters

    def run(
        self,
        objects: Iterable[tuple[ShardProgress, PlannedObject]],
        source: BlockSource,
        stop: threading.Event,
    ) -> None:
        """Blocking (a thread of its own): every object's selected blocks, until done or
        ``stop`` is set."""
        inbox = _Inbox(self._cache)
        outstanding = 0  # GETs started and not yet admitted: each holds a place under the limit
        try:
            for progress, obj in objects:
                if stop.is_set():  # also between objects whose blocks are all cached already
                    return
                run = _ObjectRun(obj, progress)
                for index in obj.blocks if obj.size else ():  # an empty file: nothing to fetch
                    if run.failed:
                        break
                    key = BlockKey.make(source.source_id, obj.key, obj.etag, index)
                    start = index * source.block_size
                    length = min(source.block_size, obj.size - start)
                    if self._verified(key, length):
                        continue
                    # A place under the limit: the answers this pipeline holds give theirs
                    # back once admitted (here, by this thread), so admit while waiting.
                    while not self._concurrency.acquire(0 if outstanding else STOP_POLL_S):
                        if stop.is_set():
                            return
                        if outstanding:
                            outstanding -= self._admit_ready(inbox, STOP_POLL_S)
                    try:
                        started = self._start(key, obj, start, length, source.config)
                    except CachefsError as exc:  # no room, the cache closed, no fetcher
                        self._concurrency.release()
                        self._failed(run, str(exc))
                        break
                    outstanding += 1
                    run.outstanding += 1
                    started.future.add_done_callback(
                        partial(inbox.deliver, run, started.reservation)
                    )
                    outstanding -= self._admit_ready(inbox, 0.0)  # what came in meanwhile
                run.submitted = True
                self._finish(run)
            while outstanding and not stop.is_set():
                outstanding -= self._admit_ready(inbox, STOP_POLL_S)
        finally:
            inbox.close()  # stopped: answers still to come are dropped, their room given back
            for _ in range(outstanding):  # ... and their places under the limit
                self._concurrency.release()

    def _start(
        self, key: BlockKey, obj: PlannedObject, start: int, length: int, config: StoreConfig
    ) -> _Started:
        """Reserve the block's room and start its GET into the reservation's file."""
        reservation = self._cache.reserve(key, length)
        if reservation is None:
            raise NotAdmitted("not admitted: the cache is full (avoid-eviction)")
        try:
            future = self._pool.start_into(
                config, obj.key, start, length, obj.etag, reservation.path
            )
        except BaseException:
            self._cache.abandon(reservation)
            raise
        return _Started(future, reservation)

    def _admit_ready(self, inbox: _Inbox, wait_s: float) -> int:
        """Admit the answers in, waiting up to ``wait_s`` for the first (0: not at all); how
        many. Their blocks are indexed in one transaction (an LMDB commit per batch,
        not per block)."""
        answers = []
        answer = inbox.next(wait_s)
        while answer is not None:
            answers.append(answer)
            answer = inbox.next()
        if answers:
            self._admit(answers)
        return len(answers)

    def _admit(self, answers: list[_Answer]) -> None:
        """Answers: their blocks into the cache (or their objects failed), places given back."""
        fetched: list[tuple[_Answer, Written]] = []
        for answer in answers:
            try:
                written = answer.future.result()
            except (FetchFailed, CancelledError) as exc:  # cancelled: the pool closed (stopping)
                throttled = False
                if isinstance(exc, FetchFailed):
                    throttled = exc.throttled
                    self._counters.got(exc.kind)
                self._cache.abandon(answer.reservation)  # a file the fetcher left goes too
                error = str(exc) or "the fetch was cancelled (the fetcher pool closed)"
                self._settle(answer, error, throttled)
            else:
                self._counters.got("ok")
                fetched.append((answer, written))
        if not fetched:
            return
        batch = [(a.reservation, w.checksum, w.chunk_checksums) for a, w in fetched]
        try:  # gives the room back itself for each file it refuses
            tiers: list[str | None] = self._cache.admit_written_many(batch)
            refused = "the block the fetcher wrote could not be admitted"
        except CachefsError as exc:
            tiers, refused = [None] * len(fetched), str(exc)
        for (answer, written), tier in zip(fetched, tiers, strict=True):
            self._settle(answer, None if tier is not None else refused, written.throttled)

    def _settle(self, answer: _Answer, error: str | None, throttled: bool) -> None:
        """One answer dealt with: its place under the limit given back, its object counted."""
        self._concurrency.record(throttled=throttled)
        self._concurrency.release()
        run = answer.run
        run.outstanding -= 1
        if error is None:
            self._counters.add(blocks=1, nbytes=answer.reservation.size)
        else:
            self._failed(run, error)
        self._finish(run)

    def _failed(self, run: _ObjectRun, error: str) -> None:
        if not run.failed:
            run.failed = run.finished = True
            self._counters.add(failures=1)
            run.progress.fail(run.obj.key, error)

    def _finish(self, run: _ObjectRun) -> None:
        if run.submitted and not run.outstanding and not run.finished:  # a failed one is finished
            run.finished = True
            run.progress.done(run.obj)

    def _verified(self, key: BlockKey, length: int) -> bool:
        """Whether the block is cached and whole: a full read checks every checksum (a bad
        block is dropped there, and fetched again here). One index lookup: a block that is not
        cached reads as None."""
        return self._cache.read(key, 0, length) is not None
