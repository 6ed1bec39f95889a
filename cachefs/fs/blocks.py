"""Block reads: cache tiers first, then the object store, with concurrent misses coalesced.

This is the heart of the read path (docs/architecture.md, "Read path"):

    read(file, offset, size) → blocks → RAM tier → SSD tier → the shard's owner (peer)
                                 → object store (admitted here only when this node is the owner)

* RAM-tier blocks are read inline on the trio loop: a pread from tmpfs costs microseconds, less
  than a thread hop. A RAM-tier hit is one index lookup (``cache.read(..., tier="ram")``); only
  when that finds nothing does ``locate`` look for the block in a slower tier.
* SSD-tier reads, store GETs and admissions run in worker threads, each kind behind its own
  CapacityLimiter so a slow store cannot starve disk reads and vice versa.
* Concurrent misses on one block share a single fetch ("single flight").
* In a cluster, a block whose shard another node owns is read from that node and not kept
  here ("passive caching off": one cached copy per block per copy of the dataset). A peer that
  fails costs one bounded timeout (then a cool-down skips it): the block is read from the store
  instead, also without admitting it — its owner will cache it.
* While this node's copy is being filled (a clone, a scale hand-off), a block it owns and does
  not hold is first asked, cached-only, of the node that held it before (the *fill source*):
  a copy over the network instead of a store read. Only if that node does not have it either
  (or fails) is the store read.
* A small in-memory set of recently fetched blocks serves the rest of a block to sequential
  readers when the block could not be admitted (avoid-eviction with full tiers): without it, a
  4 MiB block read through in 128 KiB FUSE requests would be fetched 32 times.
* Block read-ahead: a reader that reads a file in order (a TFRecord shard, a video) gets the
  blocks ahead of it fetched in the background, so one stream has many GETs in flight instead
  of one. The blocks kept ahead grow with what it has read in order: ``readahead_growth``
  times those bytes, at most ``readahead_max_blocks`` (mountpoint-s3's ramp, scaled by bytes so
  that 128 KiB and 1 MiB READs ramp alike: a short read costs little, a long stream soon has
  the store's concurrency). A first read at the start of a multi-block file fetches its second
  block ahead (a reader that starts at 0 is usually sequential; a random one loses one block).
  Strided and random readers never trigger it from there; small files have one block.
  The native READ path answers a block fetched ahead without Python, so the reads of a stream
  mostly never reach this module. Some blocks fetched ahead, the *markers* (one in every
  quarter of the window: the kernel's PG_readahead page plays the same part for its own
  read-ahead), are kept out of the native table until a read of them reaches Python; that read
  tells how far the reader has got, and the window moves on while the blocks after it are
  read, so the store always has GETs of the stream in flight.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

import outcome
import trio

from cachefs.background import BackgroundTasks
from cachefs.cache.base import BlockCache, BlockKey, CheckedBlock, OpenBlock
from cachefs.errors import CachefsError, StoreError, StoreIOError
from cachefs.metrics import WorkerMetrics
from cachefs.peer.base import BlockRequest, PeerError, PeerRefused, PeerUnavailable
from cachefs.peer.client import PeerClient
from cachefs.store.base import ObjectStore
from cachefs.store.concurrency import (
    READ_BOUNDS,
    AdaptiveConcurrency,
    ConcurrencyBounds,
    throttled_tries,
)
from cachefs.store.get_loop import LOOP_MAX_BYTES
from cachefs.store.get_thread import LoopGets
from cachefs.store.retry import backoff_s
from cachefs.store.s3 import S3Store
from cachefs.store.s3_bulk import S3BulkReader

log = logging.getLogger(__name__)

#: Block keys remembered by a BlockReader (~200 bytes each).
BLOCK_KEYS_KEPT = 4096
#: How long a stopping reader waits for its GET loop's thread (it stops within a select).
STOP_WAIT_S = 10.0

T = TypeVar("T")


async def run_in_thread(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """``trio.to_thread.run_sync(fn, limiter=limiter)`` for the read path's hops (store GETs,
    slower-tier reads), without its per-call bookkeeping: trio names the thread after ``fn``
    and the calling task on every call and back after it (two ``prctl`` calls, each a GIL
    hand-off under load) and copies the context for ``trio.from_thread``. ``fn`` must not use
    ``trio.from_thread`` or context variables. Not cancellable once started, as to_thread's
    default: the task waits for ``fn``'s outcome (an exception is re-raised here)."""
    async with limiter:
        return await _delivered(partial(trio.lowlevel.start_thread_soon, fn))


async def _delivered(start: Callable[[Callable[[outcome.Outcome[T]], None]], None]) -> T:
    """Call ``start(deliver)``, which arranges for ``deliver(an outcome)`` to be called once,
    from any thread (a thread done with its work, the GET loop's thread with a try's outcome),
    and wait for that outcome: its value, or its exception re-raised here. Not cancellable:
    the task waits for the outcome."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()

    def deliver(result: outcome.Outcome[T]) -> None:
        try:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)
        except trio.RunFinishedError:
            pass  # the trio run has ended: nobody waits

    start(deliver)
    done: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
    return done


@dataclass(frozen=True, slots=True)
class DataSource:
    """Where one dataset's bytes come from."""

    dataset: str
    store: ObjectStore
    source_id: int
    block_size: int


@dataclass(frozen=True, slots=True)
class FileVersion:
    """The object version a reader opened (from the snapshot): blocks are keyed by its etag."""

    key: str
    etag: str
    size: int


class _Flight:
    """One in-progress fetch that other readers of the same block wait on."""

    __slots__ = ("data", "done", "error", "where")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.where = "store"


class _RecentBlocks:
    """Small LRU of whole blocks that were fetched but not admitted (read-through), bounded in
    bytes and in count: it serves the rest of a block to a sequential reader, and must stay too
    small to act as a hidden cache tier."""

    MAX_BLOCKS = 16

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def get(self, key: bytes) -> bytes | None:
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > self.capacity or key in self._blocks:
            return
        self._blocks[key] = data
        self.used += len(data)
        while self.used > self.capacity or len(self._blocks) > self.MAX_BLOCKS:
            _, old = self._blocks.popitem(last=False)
            self.used -= len(old)


class PeerRoute(Protocol):
    def owner_address(self, dataset: str, shard: int) -> str | None:
        """Address of the node owning ``shard`` when that is another node; None when this node
        fetches the block itself (it owns the shard, or there is no cluster)."""
        ...

    def fill_address(self, dataset: str, shard: int) -> str | None:
        """Address of the shard's fill source when this node's copy is being filled from
        another node; None otherwise."""
        ...


#: Files whose reads the read-ahead follows (enough for every open shard).
STREAM_SLOTS = 4096
#: How far behind a stream's end a read may start and still belong to it (at least a block):
#: the kernel's own read-ahead keeps several READs of a file in flight, and one can reach
#: Python after the READ that followed it.
STRAGGLER_BYTES = 8 << 20


@dataclass(slots=True)
class _Stream:
    """One file read in order, as the read-ahead follows it (only the reads that reach Python:
    see the module's docstring on the markers)."""

    end: int  # the furthest byte a read of the stream ended at
    in_order: int  # bytes read in order since the stream began: what the window grows with
    fetched: int  # the highest block index read or fetched ahead
    # Blocks fetched ahead that stay out of the native table until a read of them comes here.
    markers: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReadLimits:
    # Object-store GETs in flight at first; adaptive from there (cachefs/store/concurrency.py:
    # up while the store keeps up, down when it answers "slow down").
    store_threads: int = READ_BOUNDS.initial
    disk_threads: int = 8  # concurrent SSD-tier reads
    admit_threads: int = 4  # concurrent admissions (file writes + index commits)
    recent_bytes: int = 64 << 20  # read-through buffer (at most _RecentBlocks.MAX_BLOCKS)
    # A reader that has read N bytes of a file in order gets readahead_growth * N bytes
    # fetched ahead of it (0: no read-ahead), at most readahead_max_blocks blocks. 16 puts
    # 12 blocks (48 MiB) in flight once 3 MiB were read: a 20 ms store's bandwidth-delay
    # product at ~600 MB/s is ~3 blocks, and the batches are fetched in parallel. The maximum
    # stays below the read-through buffer's block count, or a non-owner's blocks read ahead
    # would push out the ones it reads.
    readahead_growth: int = 16
    readahead_max_blocks: int = 12


class BlockReader:
    def __init__(
        self,
        cache: BlockCache,
        metrics: WorkerMetrics,
        limits: ReadLimits = ReadLimits(),
        *,
        peers: PeerClient | None = None,
        route: PeerRoute | None = None,
    ):
        self.cache = cache
        self.metrics = metrics
        self.peers = peers
        self.route = route
        # Store GETs of reads and fills: an adaptive limit that starts at store_threads.
        self.store_concurrency = AdaptiveConcurrency(
            ConcurrencyBounds(
                initial=limits.store_threads,
                floor=min(READ_BOUNDS.floor, limits.store_threads),
                ceiling=max(READ_BOUNDS.ceiling, limits.store_threads),
            ),
            purpose="read",
        )
        self._store_limiter = self.store_concurrency.limiter
        # First tries of small store GETs on one thread (serve_store_gets runs it); the rest,
        # and whatever it leaves undone, on threads of their own (_get_from_store).
        self._loop_gets = LoopGets(connections=READ_BOUNDS.ceiling)
        metrics.store_concurrency["read"] = self.store_concurrency.report
        self._disk_limiter = trio.CapacityLimiter(limits.disk_threads)
        # Admissions at once, in whichever thread fetched the block (threads, not trio tasks).
        self._admit_slots = threading.BoundedSemaphore(limits.admit_threads)
        # Admissions the GET loop's thread left to a thread of their own (_settle_loop_try).
        self._admit_limiter = trio.CapacityLimiter(limits.admit_threads)
        self._recent = _RecentBlocks(limits.recent_bytes)
        self._flights: dict[bytes, _Flight] = {}
        self._readahead_growth = limits.readahead_growth
        self._readahead_max_blocks = limits.readahead_max_blocks
        # (source id, object key) -> the stream the read-ahead follows; bounded, oldest dropped.
        self._streams: OrderedDict[tuple[int, str], _Stream] = OrderedDict()
        # Read-ahead fetches run here, while serve_readahead runs.
        self._background = BackgroundTasks()
        # (source id, object key, etag, index) -> its BlockKey: a block read in many requests
        # (128 KiB each, 32 per 4 MiB block) hashes its key once. Cleared when full.
        self._block_keys: dict[tuple[int, str, str, int], BlockKey] = {}
        # dataset -> time.time() of its last read here, by a local reader or a peer (what the
        # coordinator's idle-copy cleanup looks at). One dict store per read request.
        self.last_read_at: dict[str, float] = {}

    async def read(
        self,
        source: DataSource,
        file: FileVersion,
        offset: int,
        size: int,
        *,
        read_ahead_done: Callable[[int], None] | None = None,
    ) -> bytes:
        """Bytes ``[offset, offset+size)`` of ``file``, clipped at its end.
        ``read_ahead_done(index)`` is called when a block this read started fetching ahead
        has been fetched (and admitted, where this node admits it)."""
        self.last_read_at[source.dataset] = time.time()
        end = min(offset + size, file.size)
        if offset >= end:
            return b""
        block_size = source.block_size
        first, last = offset // block_size, (end - 1) // block_size
        self._follow(source, file, offset, end, read_ahead_done)
        if first == last:
            start = first * block_size
            return await self._read_block(source, file, first, offset - start, end - offset)
        parts = []
        for index in range(first, last + 1):
            start = index * block_size
            lo, hi = max(offset, start), min(end, start + block_size)
            parts.append(await self._read_block(source, file, index, lo - start, hi - lo))
        return b"".join(parts)

    @property
    def fetches_in_flight(self) -> int:
        """Blocks being fetched now (by readers, read-ahead and prefetch hints)."""
        return len(self._flights)

    def block_key(self, source: DataSource, file: FileVersion, index: int) -> BlockKey:
        identity = (source.source_id, file.key, file.etag, index)
        key = self._block_keys.get(identity)
        if key is None:
            if len(self._block_keys) >= BLOCK_KEYS_KEPT:
                self._block_keys.clear()
            key = self._block_keys[identity] = BlockKey.make(*identity)
        return key

    async def serve_readahead(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run read-ahead fetches until cancelled (the worker starts this in its nursery)."""
        await self._background.run(task_status=task_status)

    async def serve_store_gets(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the thread of the store GETs' loop (cachefs/store/get_thread.py) until
        cancelled; the worker starts this in its nursery. Without it, every GET runs on a
        thread of its own."""
        thread = threading.Thread(
            target=self._loop_gets.run, name="cachefs-store-gets", daemon=True
        )
        thread.start()
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            self._loop_gets.stop()  # tries in flight come back "not done" first
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join, STOP_WAIT_S)

    def next_marker(self, source: DataSource, file: FileVersion, after: int) -> int | None:
        """The first block of ``file`` past block ``after`` whose first read must reach Python
        (a read-ahead marker: registered in the native table only after that read), or None."""
        stream = self._streams.get((source.source_id, file.key))
        if stream is None:
            return None
        return min((m for m in stream.markers if m > after), default=None)

    def _follow(
        self,
        source: DataSource,
        file: FileVersion,
        offset: int,
        end: int,
        done: Callable[[int], None] | None,
    ) -> None:
        """Follow the stream this read belongs to and fetch the blocks its window now covers
        that were not fetched for it yet. A read is in order when it starts no earlier than
        :data:`STRAGGLER_BYTES` (or a block) before where the stream ended (the kernel's
        read-ahead can send a READ late) and no later than the first marker not read yet, or
        without one the block after the last one fetched: the blocks between were read by the
        native path, which this module does not see, but a marker's READ always comes here,
        so a read past one skipped it. A read at offset 0 (a file read once more from its
        start) and any other read start a new stream; one at offset 0 fetches the next block
        ahead, as a first read does."""
        block_size = source.block_size
        last = (end - 1) // block_size
        slot = (source.source_id, file.key)
        stream = self._streams.pop(slot, None)
        if (
            stream is not None
            and offset > 0
            and stream.end - max(block_size, STRAGGLER_BYTES) <= offset
            and offset // block_size <= min(stream.markers, default=stream.fetched + 1)
        ):
            read_before = stream.in_order + max(0, offset - stream.end)
            stream.in_order = read_before + max(0, end - max(offset, stream.end))
            stream.end = max(stream.end, end)
            ahead = min(
                self._readahead_max_blocks,
                -(-read_before * self._readahead_growth // block_size),
            )
        else:
            stream = _Stream(end=end, in_order=end - offset, fetched=last)
            ahead = (
                min(1, self._readahead_max_blocks) if offset == 0 and self._readahead_growth else 0
            )
        stream.fetched = max(stream.fetched, last)
        if stream.markers:  # the ones this read reached may enter the native table now
            stream.markers = [m for m in stream.markers if m > last]
        self._streams[slot] = stream
        if len(self._streams) > STREAM_SLOTS:
            self._streams.popitem(last=False)
        if not self._background.running or not ahead:
            return
        final = (file.size - 1) // block_size
        batch = range(stream.fetched + 1, min(last + ahead, final) + 1)
        if not batch:
            return
        stream.fetched = batch[-1]
        wanted = []
        for index in batch:
            key = self.block_key(source, file, index)
            if key.raw in self._flights or self._recent.get(key.raw) is not None:
                continue
            if self.cache.locate(key) is not None:
                continue
            wanted.append((index, key))
        # Markers are blocks this batch fetches (a block cached before may be in the native
        # table already, and a read of it would never come here): its first, and one in every
        # quarter of the window after it.
        every = max(1, ahead // 4)
        for n, (index, key) in enumerate(wanted):
            report = done
            if n % every == 0:
                stream.markers.append(index)
                report = None
            self._background.start_soon(self._read_ahead, source, file, index, key, report)

    async def _read_ahead(
        self,
        source: DataSource,
        file: FileVersion,
        index: int,
        key: BlockKey,
        done: Callable[[int], None] | None,
    ) -> None:
        """One block fetched ahead of a reader: as a miss would fetch it (owner, fill source,
        store; admitted where a miss would admit it), then ``done(index)``. A failure is only
        logged: the reader's own read of the block will meet it, or succeed on retry."""
        owner = self.route.owner_address(source.dataset, key.shard) if self.route else None
        try:
            await self._fetch(source, file, index, key, peer=owner)
        except CachefsError as exc:
            log.debug("read-ahead of block %d of %s failed: %s", index, file.key, exc)
            return
        self.metrics.readahead_blocks += 1
        if done is not None:
            done(index)

    async def fetch_ahead(self, source: DataSource, file: FileVersion, index: int) -> str | None:
        """Fetch one block for a reader that said it will read it soon (a prefetch hint), as a
        miss would: from the owner, the fill source or the store, admitted where a miss would
        admit it, and sharing the fetch with any concurrent read of the block. Returns where
        it came from, or None when it is cached already; raises CachefsError when the fetch
        fails."""
        key = self.block_key(source, file, index)
        # Checked here, not only by the caller: a read may have cached the block since, and
        # no checkpoint separates this check from _fetch registering its flight.
        if self.cache.locate(key) is not None:
            return None
        owner = self.route.owner_address(source.dataset, key.shard) if self.route else None
        _data, where = await self._fetch(source, file, index, key, peer=owner)
        return where

    async def _read_block(
        self, source: DataSource, file: FileVersion, index: int, offset: int, length: int
    ) -> bytes:
        key = self.block_key(source, file, index)
        metrics = self.metrics
        data = self.cache.read(key, offset, length, tier="ram")
        if data is not None:
            metrics.hits["ram"] += 1
            metrics.bytes_served["ram"] += len(data)
            return data
        tier = self.cache.locate(key)  # not in RAM: in a slower tier?
        if tier is not None:
            data = await run_in_thread(
                partial(self.cache.read, key, offset, length), self._disk_limiter
            )
            if data is not None:
                metrics.hits[tier] += 1
                metrics.bytes_served[tier] += len(data)
                return data
        # Not cached, or the block vanished or failed verification (then it was dropped).
        recent = self._recent.get(key.raw)
        if recent is not None:
            metrics.hits["recent"] += 1
            metrics.bytes_served["recent"] += length
            return recent[offset : offset + length]
        metrics.misses += 1
        owner = self.route.owner_address(source.dataset, key.shard) if self.route else None
        block, where = await self._fetch(source, file, index, key, peer=owner)
        metrics.bytes_served[where] += length
        return block[offset : offset + length]

    async def read_owned_block(
        self, source: DataSource, file: FileVersion, index: int
    ) -> CheckedBlock | OpenBlock:
        """A whole block for a peer that asked this node, its owner: from the cache (with the
        chunk checksums recorded at its admission), else from the store and admitted here.
        Never forwarded to another node as a plain request (two nodes with different views of
        the membership must not send one back and forth).

        For up to a heartbeat after a membership change (a scale, a clone) the asker may know
        before this node does that this node owns the shard. If this node's view still names
        another owner, that node likely holds the block: it is asked cached-only (which is
        never forwarded again), and this node does not admit the block until its own view
        says it owns the shard — the hand-off or fill copies it then."""
        self.last_read_at[source.dataset] = time.time()
        key = self.block_key(source, file, index)
        block = await self._read_whole_cached(key)
        if block is None:
            holder = self.route.owner_address(source.dataset, key.shard) if self.route else None
            data, _ = await self._fetch(source, file, index, key, holder=holder)
            block = CheckedBlock.of(data)  # just fetched: checksummed as its admission does
        self.metrics.peer_served += 1
        return block

    async def read_cached_block(
        self, source: DataSource, file: FileVersion, index: int
    ) -> CheckedBlock | OpenBlock | None:
        """A whole block from this node's cache only, or None if it is not cached (a peer's
        cached-only request: never the store, never another node). Not counted as a read of
        the dataset: it is a copy being filled, not a job reading, and counting it would keep
        the copy it is cloned from looking busy."""
        block = await self._read_whole_cached(self.block_key(source, file, index))
        if block is not None:
            self.metrics.peer_served += 1
        return block

    def ram_block_now(
        self, source: DataSource, file: FileVersion, index: int, *, a_read: bool
    ) -> CheckedBlock | OpenBlock | None:
        """A whole block for a peer, without waiting, if it is in the RAM tier (checked inline,
        as :meth:`_read_whole_cached` checks it), else None. ``a_read``: the request counts as
        a read of the dataset (an owner's request; a cached-only one fills a copy)."""
        block = self.cache.open_verified(self.block_key(source, file, index), tier="ram")
        if block is not None:
            if a_read:
                self.last_read_at[source.dataset] = time.time()
            self.metrics.peer_served += 1
        return block

    async def _read_whole_cached(self, key: BlockKey) -> CheckedBlock | OpenBlock | None:
        """A whole cached block for a peer: a RAM-tier block checked inline and handed over as
        an open file to send from; another tier's read in a thread (it may wait for a disk)."""
        block = self.cache.open_verified(key, tier="ram")
        if block is not None or self.cache.locate(key) is None:
            return block
        return await run_in_thread(partial(self.cache.open_verified, key), self._disk_limiter)

    async def _fetch(
        self,
        source: DataSource,
        file: FileVersion,
        index: int,
        key: BlockKey,
        *,
        peer: str | None = None,
        holder: str | None = None,
    ) -> tuple[bytes, str]:
        """Fetch a whole block with one fetch per block at a time: from ``peer`` (the owner) if
        given; else this node is the owner: from the fill source if there is one, else from
        the store, and admit it. ``holder``: a node that is not the fill source but may hold
        the block (see :meth:`read_owned_block`): asked cached-only first, and the block is
        not admitted. Returns the data and where it came from."""
        while True:
            flight = self._flights.get(key.raw)
            if flight is None:
                break
            self.metrics.fetch_coalesced += 1
            await flight.done.wait()
            if flight.data is not None:
                return flight.data, flight.where
            if isinstance(flight.error, CachefsError):
                raise flight.error
            # The leader was cancelled (its FUSE request interrupted): try again ourselves.

        flight = self._flights[key.raw] = _Flight()
        try:
            data = None
            if peer is not None:
                data = await self._get_from_peer(peer, source, file, index)
            elif self.route is not None:
                fill = holder or self.route.fill_address(source.dataset, key.shard)
                if fill is not None:
                    data = await self._get_from_peer(fill, source, file, index, cached_only=True)
            # Only the owner admits; a non-owner reads through, so the block stays cached once
            # per copy. A block from the store is admitted in the thread that fetched it (one
            # hop off the trio loop per miss, not two).
            owner = peer is None and holder is None
            admitted = None
            if data is not None:
                flight.where = "peer"
                if owner:
                    admitted = await trio.to_thread.run_sync(self._admit, key, data)
            else:
                data, admitted = await self._get_from_store(
                    source, file, index, admit_as=key if owner else None
                )
                flight.where = "store"
            if admitted is None:
                self._recent.put(key.raw, data)
            flight.data = data
            return data, flight.where
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            del self._flights[key.raw]
            flight.done.set()

    async def _get_from_peer(
        self,
        address: str,
        source: DataSource,
        file: FileVersion,
        index: int,
        *,
        cached_only: bool = False,
    ) -> bytes | None:
        """The block from its owner (or, ``cached_only``, from the fill source's cache), or
        None when that node cannot serve it (then the caller reads the store): a peer problem
        never becomes a read error. Outcomes of fill-source requests are counted as
        ``fill_<outcome>``: a "not cached" there is expected, not a peer declining."""
        request = BlockRequest(
            source.dataset, file.key, file.etag, file.size, index, source.block_size, cached_only
        )
        label = "fill_" if cached_only else ""
        assert self.peers is not None  # a reader given a route is given its peer client too
        try:
            data = await self.peers.get_block(address, request)
        except PeerUnavailable:
            self.metrics.peer_request(label + "cooling")
            return None
        except PeerRefused as exc:
            self.metrics.peer_request(label + "refused")
            log.debug("peer %s declined a block, reading the store: %s", address, exc)
            return None
        except PeerError as exc:
            self.metrics.peer_request(label + "failed")
            log.info("peer read from %s failed, reading the store: %s", address, exc)
            return None
        self.metrics.peer_request(label + "ok")
        return data

    def _admit(self, key: BlockKey, data: bytes) -> str | None:
        """Blocking (in a thread): ``cache.put`` within the admission slots."""
        with self._admit_slots:
            return self.cache.put(key, data)

    async def _get_from_store(
        self, source: DataSource, file: FileVersion, index: int, *, admit_as: BlockKey | None
    ) -> tuple[bytes, str | None]:
        """The block from the store and, with ``admit_as``, the tier that admitted it under
        that key (None: not admitted). A small block of an S3 source has its first try in the
        GET loop (:meth:`_get_in_loop`); anything else, and whatever the loop leaves undone,
        runs the store's ``get_range`` on a thread."""
        start = index * source.block_size
        length = min(source.block_size, file.size - start)
        began = time.perf_counter()
        answered = began  # when the store's answer was in (set in the thread)
        throttled = False  # the store answered "slow down" to a try of this GET

        def get_and_admit(after_s: float) -> tuple[bytes, str | None]:
            nonlocal answered, throttled
            time.sleep(after_s)  # after the loop's try was told "slow down": a backoff
            before = throttled_tries(source.store)
            try:
                data = source.store.get_range(file.key, start, length, etag=file.etag)
            finally:
                throttled = throttled or throttled_tries(source.store) > before
            answered = time.perf_counter()
            if admit_as is None or len(data) != length:
                return data, None
            return data, self._admit(admit_as, data)

        try:
            got = None
            reader = self._loop_reader(source, length)
            if reader is not None:
                async with self._store_limiter:
                    got = await self._get_in_loop(reader, file, start, length, admit_as)
                throttled = got.throttled
                answered = got.answered
            if got is not None and got.data is not None:
                data, admitted = got.data, got.admitted
                self.metrics.store_gets_in_loop += 1
                if got.admit_later and admit_as is not None:
                    admitted = await run_in_thread(
                        partial(self._admit, admit_as, data), self._admit_limiter
                    )
            else:
                after_s = backoff_s(reader.retry, 1, random.random) if reader and throttled else 0
                data, admitted = await run_in_thread(
                    partial(get_and_admit, after_s), self._store_limiter
                )
        except StoreError as exc:
            self.metrics.store_request("get", type(exc).__name__, time.perf_counter() - began)
            self.store_concurrency.record(throttled=throttled)
            raise exc.with_context(dataset=source.dataset, key=file.key) from exc
        self.store_concurrency.record(throttled=throttled)
        self.metrics.store_request("get", "ok", answered - began)
        if len(data) != length:  # the store contract forbids this; never serve it if it happens
            raise StoreIOError(
                f"store returned {len(data)} bytes for a {length}-byte range at {start}",
                dataset=source.dataset,
                key=file.key,
            )
        self.metrics.store_bytes += length
        return data, admitted

    def _loop_reader(self, source: DataSource, length: int) -> S3BulkReader | None:
        """The lean client whose GET the loop may send for a block of ``length`` bytes of
        ``source``, or None (not S3, boto3's GETs, a large block, the lean client not opened
        yet: a dataset add opens it, and opening may wait on the network, so a thread does it
        otherwise; or the loop is not running)."""
        if not 0 < length <= LOOP_MAX_BYTES or not self._loop_gets.running:
            return None
        store = source.store
        return store.opened_bulk_reader() if isinstance(store, S3Store) else None

    async def _get_in_loop(
        self,
        reader: S3BulkReader,
        file: FileVersion,
        start: int,
        length: int,
        admit_as: BlockKey | None,
    ) -> _LoopGot:
        """The block's first try in the GET loop, admitted there (on the loop's thread: no
        thread hop, no GIL hand-off) when ``admit_as`` is given. Its data is None when the loop
        left the try undone; a permanent error answer raises the store's error. Not
        cancellable once sent (as :func:`run_in_thread`): the loop ends every try within the
        policy's bounds, or when it stops."""

        def send(deliver: Callable[[outcome.Outcome[_LoopGot]], None]) -> None:
            def done(body: bytearray | StoreError | None, throttled: bool) -> None:  # loop's
                deliver(outcome.capture(self._settle_loop_try, body, throttled, admit_as))

            self._loop_gets.submit(reader, file.key, start, length, file.etag, done)

        return await _delivered(send)

    def _settle_loop_try(
        self, body: bytearray | StoreError | None, throttled: bool, admit_as: BlockKey | None
    ) -> _LoopGot:
        """On the loop's thread: a try's outcome, its block admitted (blocking, briefly)."""
        answered = time.perf_counter()
        if isinstance(body, StoreError):
            raise body
        if body is None:
            return _LoopGot(None, None, throttled, answered)
        data = bytes(body)
        if admit_as is None:
            return _LoopGot(data, None, throttled, answered)
        # Admitted here only with an admission slot free at once: the loop must not wait for
        # one while the other GETs' answers arrive (else the task admits it on a thread).
        if not self._admit_slots.acquire(blocking=False):
            return _LoopGot(data, None, throttled, answered, admit_later=True)
        try:
            admitted = self.cache.put(admit_as, data)
        finally:
            self._admit_slots.release()
        return _LoopGot(data, admitted, throttled, answered)


class _LoopGot(NamedTuple):
    """A GET loop's try: its bytes (None: not done there), the tier that admitted them,
    whether the store said "slow down", and when the answer was in (perf_counter)."""

    data: bytes | None
    admitted: str | None
    throttled: bool
    answered: float
    admit_later: bool = False  # no admission slot was free on the loop's thread
