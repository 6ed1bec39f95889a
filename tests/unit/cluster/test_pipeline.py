"""The preload's FetchPipeline: failures, a full cache, and stopping with GETs in flight.

The happy path over real fetches is in test_preloader.py (a local store, ``FetcherPool(0)``) and
tests/e2e/cluster (fetcher processes, an S3 endpoint). Here the pool is a stand-in below the
pool's seam (``start_into``: a future per GET; the real pool is tested in
tests/e2e/cluster/test_fetchers.py) whose GETs the test answers when it chooses, so the moments
a pipeline stops or fails at are exact. The cache is real (LMDB and tier files under tmp_path).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey, checksum, chunk_checksums
from cachefs.cache.tier import write_new_file
from cachefs.cluster.fetchers import FetchFailed, Written
from cachefs.cluster.pipeline import BlockSource, FetchCounters, FetchPipeline, ShardProgress
from cachefs.cluster.planning import PlannedObject
from cachefs.store import StoreConfig
from cachefs.store.concurrency import ConcurrencyBounds, ThreadedConcurrency
from tests.waiting import WAIT_S, wait_for

BLOCK = 16 * 1024
SOURCE = BlockSource(StoreConfig(uri="file:///nowhere"), source_id=7, block_size=BLOCK)


def content(key: str, offset: int, length: int) -> bytes:
    pattern = f"{key}@{offset};".encode()
    return (pattern * (length // len(pattern) + 1))[:length]


class HeldPool:
    """Starts no GET: records each request; the test answers them (writing the file as a
    fetcher process would) or fails them."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, int, str, Future[Written]]] = []
        self._lock = threading.Lock()

    def start_into(self, config, key, offset, length, etag, path) -> Future[Written]:
        future: Future[Written] = Future()
        with self._lock:
            self.requests.append((key, offset, length, path, future))
        return future

    def answer(self, index: int) -> None:
        key, offset, length, path, future = self.requests[index]
        data = content(key, offset, length)
        write_new_file(path, data)
        future.set_result(Written(checksum(data), chunk_checksums(data), throttled=False))

    def fail(self, index: int, reason: str) -> None:
        self.requests[index][4].set_exception(FetchFailed(reason))


def planned(key: str, size: int) -> PlannedObject:
    blocks = tuple(range(-(-size // BLOCK)))
    return PlannedObject(key, "etag", size, blocks, size)


@pytest.fixture
def cache(tmp_path):
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 64 * BLOCK)]
    )
    yield cache
    cache.close()


def start(cache, pool, objects, *, limit: int = 4):
    concurrency = ThreadedConcurrency(
        ConcurrencyBounds(initial=limit, floor=1, ceiling=limit), purpose="test"
    )
    pipeline = FetchPipeline(cache, pool, concurrency, FetchCounters())
    progress = ShardProgress(objects=len(objects))
    stop = threading.Event()
    thread = threading.Thread(
        target=pipeline.run, args=([(progress, o) for o in objects], SOURCE, stop)
    )
    thread.start()
    return thread, stop, progress, concurrency


def room_left(cache) -> int:
    usage = cache.usage()[0]
    return usage.capacity - usage.used


def tmp_files(tmp_path) -> list[str]:
    return os.listdir(tmp_path / "ram" / "tmp")


def test_every_block_is_admitted_and_objects_count_done_once_whole(cache):
    pool = HeldPool()
    objects = [planned("a", 3 * BLOCK - 1), planned("b", 10)]
    thread, _, progress, _ = start(cache, pool, objects)
    wait_for(lambda: len(pool.requests) == 4, "every block's GET to start")
    pool.answer(3)  # b's only block first: answers come in any order
    pool.answer(0)
    pool.answer(1)
    wait_for(lambda: progress.report()["done_objects"] == 1, "b to be done")
    assert progress.report()["done_objects"] == 1  # a is not whole yet
    pool.answer(2)
    thread.join(WAIT_S)

    assert not thread.is_alive()
    assert progress.report()["done_objects"] == 2
    assert progress.report()["done_bytes"] == 3 * BLOCK - 1 + 10
    for key, offset, length, _, _ in pool.requests:
        index = offset // BLOCK
        assert cache.read(BlockKey.make(7, key, "etag", index)) == content(key, offset, length)


def test_a_failed_get_fails_its_object_with_the_reason_and_gives_its_room_back(cache, tmp_path):
    pool = HeldPool()
    thread, _, progress, concurrency = start(cache, pool, [planned("a", 2 * BLOCK)])
    wait_for(lambda: len(pool.requests) == 2, "both GETs to start")
    pool.fail(0, "store: 503 slow down, gave up")
    pool.answer(1)
    thread.join(WAIT_S)

    report = progress.report()
    assert (report["done_objects"], report["failed_count"]) == (0, 1)
    assert report["failed"] == {"a": "store: 503 slow down, gave up"}
    assert room_left(cache) == 64 * BLOCK - BLOCK  # only the block that arrived holds room
    assert tmp_files(tmp_path) == []
    assert concurrency.in_flight == 0


def test_a_full_cache_fails_the_object_without_fetching(tmp_path):
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), BLOCK)]
    )
    try:
        pool = HeldPool()
        thread, _, progress, _ = start(cache, pool, [planned("big", 2 * BLOCK)])
        wait_for(lambda: len(pool.requests) == 1, "the first block's GET to start")
        pool.answer(0)
        thread.join(WAIT_S)

        report = progress.report()
        assert report["failed"] == {"big": "not admitted: the cache is full (avoid-eviction)"}
        assert len(pool.requests) == 1  # the second block had no room: never asked for
    finally:
        cache.close()


def test_stopping_with_gets_in_flight_returns_and_leaves_no_room_or_file_taken(cache, tmp_path):
    pool = HeldPool()
    objects = [planned(f"k{i}", BLOCK) for i in range(10)]
    thread, stop, progress, concurrency = start(cache, pool, objects, limit=3)
    wait_for(lambda: len(pool.requests) == 3, "the limit's worth of GETs to start")
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert concurrency.in_flight == 0  # places given back at once

    for index in range(3):  # the GETs end after the pipeline stopped: dropped, not admitted
        pool.answer(index)
    assert progress.report()["done_objects"] == 0
    assert room_left(cache) == 64 * BLOCK
    assert tmp_files(tmp_path) == []
    assert len(pool.requests) == 3


def test_blocks_already_cached_are_verified_and_not_fetched_again(cache):
    data = content("a", 0, BLOCK)
    cache.put(BlockKey.make(7, "a", "etag", 0), data)
    pool = HeldPool()
    thread, _, progress, _ = start(cache, pool, [planned("a", 2 * BLOCK)])
    wait_for(lambda: len(pool.requests) == 1, "the missing block's GET to start")
    pool.answer(0)
    thread.join(WAIT_S)

    assert [offset for _, offset, _, _, _ in pool.requests] == [BLOCK]
    assert progress.report()["done_objects"] == 1
