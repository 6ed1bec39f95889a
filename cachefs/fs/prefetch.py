"""Prefetch hints: a same-node reader (tf_dataset, ahead of its pipeline) names the files it
will read soon, and their blocks are fetched into the cache before it reads them. The model is
mountpoint-s3's prefetch.rs: bounded, in the background, through the read path's own fetch.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import trio

from cachefs.cache.base import BlockCache, BlockKey
from cachefs.errors import CachefsError
from cachefs.fs.blocks import DataSource, FileVersion
from cachefs.fs.core import FileSystem
from cachefs.fs.layout import file_blocks

log = logging.getLogger("cachefs.worker")


@dataclass
class PrefetchCounters:
    hinted_files: int = 0  # file paths received in hints
    dropped_files: int = 0  # dropped unprocessed because the queue was full (oldest first)
    unknown_files: int = 0  # not a file of the dataset when processed
    blocks_fetched: int = 0  # fetched into the cache (or from the owner, in a cluster)
    blocks_cached: int = 0  # already cached here: nothing to do
    blocks_no_room: int = 0  # skipped: the tiers are full and admission avoids eviction
    blocks_failed: int = 0  # the fetch failed (the reader's own read will retry it)


class Prefetcher:
    """Fetches the blocks of files a same-node reader says it will read soon (prefetch hints,
    sent by tf_dataset ahead of its pipeline), so that its reads find them cached.

    Hints wait in a queue of at most ``max_queued`` files; past that the *oldest* are dropped
    (and counted): a reader that hints ahead of itself makes its oldest hints the least useful
    ones, since it is reading those files now and its reads fetch them anyway. One task takes
    files in order and starts at most ``concurrency`` block fetches at once, each through
    ``BlockReader.fetch_ahead`` — the read path's own fetch: a FUSE read of a block being
    prefetched waits for that fetch instead of starting another, a cluster node gets the block
    from its shard's owner, and the store limiter is shared, of which prefetches hold at most
    ``concurrency`` slots so FUSE misses keep the rest. Nothing here ever blocks a FUSE read.
    """

    def __init__(
        self, fs: FileSystem, cache: BlockCache, *, evicts: bool, max_queued: int, concurrency: int
    ) -> None:
        self._fs = fs
        self._cache = cache
        self._evicts = evicts
        self._queue: deque[tuple[str, str]] = deque()
        self._max_queued = max_queued
        self._slots = trio.Semaphore(max(1, concurrency))
        self._hinted = trio.Event()
        self.counters = PrefetchCounters()

    def __len__(self) -> int:
        return len(self._queue)

    def hint(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        """Queue files (called on the trio loop by the control API; never waits)."""
        dropped = 0
        for path in paths:
            self._queue.append((dataset, path))
        overflow = len(self._queue) - self._max_queued
        for _ in range(max(0, overflow)):
            self._queue.popleft()
            dropped += 1
        self.counters.hinted_files += len(paths)
        self.counters.dropped_files += dropped
        if self._queue:
            self._hinted.set()
        # "dropped" counts hints of this request and older ones alike: whichever were oldest.
        accepted = min(len(paths), self._max_queued)
        return {"accepted": accepted, "dropped": dropped, "queued": len(self._queue)}

    def status(self) -> dict[str, Any]:
        return {**asdict(self.counters), "queued_files": len(self._queue)}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Process hints until cancelled (the worker starts this in its background nursery)."""
        async with trio.open_nursery() as fetches:
            task_status.started()
            while True:
                if not self._queue:
                    self._hinted = trio.Event()
                    await self._hinted.wait()
                    continue
                dataset, path = self._queue.popleft()
                try:
                    await self._prefetch_file(fetches, dataset, path)
                except CachefsError as exc:  # e.g. the dataset went away: a hint never fails us
                    self.counters.unknown_files += 1
                    log.debug("prefetch of %s/%s skipped: %s", dataset, path, exc)

    async def _prefetch_file(self, fetches: trio.Nursery, dataset: str, path: str) -> None:
        mounted = self._fs.dataset(dataset)
        entry = None if mounted is None else mounted.snapshot.resolve(path.strip("/"))
        if mounted is None or entry is None or entry.is_dir:
            self.counters.unknown_files += 1
            return
        source = mounted.source  # kept: the fetches finish against the version hinted
        file = FileVersion(entry.key, entry.etag, entry.size)
        for block in file_blocks(source, entry):
            if self._cache.locate(block.key) is not None:
                self.counters.blocks_cached += 1
                continue
            if not self._room_for(source, block.key, block.length):
                self.counters.blocks_no_room += 1
                continue
            await self._slots.acquire()  # the queue waits here, never a FUSE read
            fetches.start_soon(self._fetch_block, source, file, block.index)

    def _room_for(self, source: DataSource, key: BlockKey, length: int) -> bool:
        """Whether fetching the block can leave it cached: not when this node would admit it
        but its tiers are full and the policy avoids eviction (the block would be read through
        and forgotten: a store GET for nothing)."""
        route = self._fs.reader.route
        if route is not None and route.owner_address(source.dataset, key.shard) is not None:
            return True  # another node owns it: fetching it makes that node cache it
        if self._evicts:
            return True
        return any(tier.capacity - tier.used >= length for tier in self._cache.usage())

    async def _fetch_block(self, source: DataSource, file: FileVersion, index: int) -> None:
        try:
            where = await self._fs.reader.fetch_ahead(source, file, index)
        except CachefsError as exc:
            self.counters.blocks_failed += 1
            log.debug("prefetch of block %d of %s failed: %s", index, file.key, exc)
        else:
            if where is None:  # a read cached it while this fetch waited for a slot
                self.counters.blocks_cached += 1
            else:
                self.counters.blocks_fetched += 1
        finally:
            self._slots.release()
