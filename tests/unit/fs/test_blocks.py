"""The block read path below FUSE: BlockReader over a real TieredBlockCache and a real local
store. The store is wrapped (below SEAM A, whose real implementations have their own tests) only
to count and slow down requests, so that concurrent misses really overlap."""

from __future__ import annotations

import os
import random
import threading

import pytest
import trio
import trio.testing

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.errors import StoreUnavailable
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion, ReadLimits, run_in_thread
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from tests.fakes.wrappers import CountingStore
from tests.waiting import wait_until

BLOCK = 16 * 1024


@pytest.fixture
def world(tmp_path):
    rng = random.Random(5)
    source = tmp_path / "source"
    source.mkdir()
    data = rng.randbytes(5 * BLOCK + 77)
    (source / "f.bin").write_bytes(data)
    store = CountingStore(open_store(StoreConfig(uri=f"file://{source}")), delay_s=0.2)
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 1 << 20)]
    )
    metrics = WorkerMetrics()
    reader = BlockReader(cache, metrics, ReadLimits())
    info = store.inner.head("f.bin")
    version = FileVersion(info.key, info.etag, info.size)
    yield reader, DataSource("ds", store, 1, BLOCK), version, data, store, metrics
    cache.close()


async def test_concurrent_misses_on_one_block_share_one_fetch(world):
    reader, source, version, data, store, metrics = world
    results = {}

    async def read(offset: int) -> None:
        results[offset] = await reader.read(source, version, offset, 1000)

    async with trio.open_nursery() as nursery:
        for offset in range(0, BLOCK - 1000, 1000):
            nursery.start_soon(read, offset)
    assert all(results[o] == data[o : o + 1000] for o in results)
    assert store.gets == 1
    assert metrics.fetch_coalesced == len(results) - 1


async def test_reads_spanning_blocks_and_past_the_end(world):
    reader, source, version, data, _store, _ = world
    assert (
        await reader.read(source, version, BLOCK - 10, 3 * BLOCK)
        == data[BLOCK - 10 : 4 * BLOCK - 10]
    )
    assert await reader.read(source, version, len(data) - 5, 100) == data[-5:]
    assert await reader.read(source, version, len(data) + 5, 100) == b""
    assert await reader.read(source, version, 0, len(data) + 1000) == data


async def test_a_failed_fetch_fails_every_waiter_and_the_next_read_retries(world):
    reader, source, version, data, store, _ = world
    store.fail = True
    errors = []

    async def read() -> None:
        try:
            await reader.read(source, version, 0, 10)
        except StoreUnavailable as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(read)
    assert len(errors) == 5 and store.gets == 1
    assert "dataset 'ds'" in str(errors[0])  # the error names the dataset and key
    store.fail = False
    assert await reader.read(source, version, 0, 10) == data[:10]


async def test_a_cancelled_leader_does_not_fail_its_waiters(world):
    reader, source, version, data, _store, _ = world
    got = []

    async def waiter() -> None:
        got.append(await reader.read(source, version, 100, 10))

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(0.05):  # cancel the leader mid-fetch
            async with trio.open_nursery() as leader_nursery:
                leader_nursery.start_soon(reader.read, source, version, 0, 10)
                await trio.sleep(0.01)
                nursery.start_soon(waiter)
                await trio.sleep(1)
    assert got == [data[100:110]]


async def test_changed_source_file_is_an_error_not_new_bytes(world, tmp_path):
    reader, source, version, data, _store, _ = world
    path = tmp_path / "source" / "f.bin"
    path.write_bytes(os.urandom(len(data)))
    os.utime(path, ns=(1, 1))
    with pytest.raises(Exception, match=r"(?i)changed|etag"):
        await reader.read(source, version, 2 * BLOCK, 10)


async def read_in_steps(reader, source, version, offsets, step):
    return b"".join([await reader.read(source, version, o, step) for o in offsets])


async def test_a_sequential_reader_gets_the_next_blocks_fetched_ahead(world):
    """A first read at offset 0 fetches block 1 ahead; moving on from block 0 into block 1
    starts fetches of blocks 2..5 in the background: the reader then finds them cached or in
    flight, each block is fetched once, and the bytes are the file's."""
    reader, source, version, data, store, metrics = world
    step = BLOCK // 4
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        got = await read_in_steps(reader, source, version, range(0, BLOCK, step), step)
        await wait_until(lambda: metrics.readahead_blocks == 1, "block 1 read ahead")
        got += await read_in_steps(reader, source, version, range(BLOCK, 2 * BLOCK, step), step)
        await wait_until(lambda: metrics.readahead_blocks == 5, "blocks 2..5 read ahead")
        assert store.gets == 6  # block 0 on demand, 1..5 ahead: every block once
        got += await read_in_steps(reader, source, version, range(2 * BLOCK, len(data), step), step)
        nursery.cancel_scope.cancel()
    assert got == data
    assert store.gets == 6 and metrics.misses == 1


async def test_the_read_ahead_window_doubles_as_a_reader_moves_on_and_restarts_after_a_jump(
    tmp_path,
):
    """Reference model: window 1 after a first read at 0, then 2 (the configured start),
    4, 8 and at most 8; a jump starts again. Each step waits for the read-ahead it started,
    so the store's GET count is exactly the blocks reached."""
    source_dir = tmp_path / "source"
    source_dir.mkdir()
    data = random.Random(9).randbytes(40 * BLOCK)
    (source_dir / "long.bin").write_bytes(data)
    store = CountingStore(open_store(StoreConfig(uri=f"file://{source_dir}")), delay_s=0.01)
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 4 << 20)]
    )
    metrics = WorkerMetrics()
    reader = BlockReader(cache, metrics, ReadLimits(readahead_blocks=2, readahead_max_blocks=8))
    info = store.inner.head("long.bin")
    version = FileVersion(info.key, info.etag, info.size)
    source = DataSource("ds", store, 1, BLOCK)
    # (block read, the highest block fetched once its read-ahead is done)
    model = [(0, 1), (1, 3), (2, 6), (3, 11), (4, 12), (5, 13), (30, 30), (31, 33), (32, 36)]
    fetched: set[int] = set()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve_readahead)
            for index, highest in model:
                got = await reader.read(source, version, index * BLOCK, BLOCK)
                assert got == data[index * BLOCK : (index + 1) * BLOCK]
                fetched |= set(range(index, highest + 1))
                await wait_until(
                    lambda n=len(fetched): store.gets >= n and reader.fetches_in_flight == 0,
                    f"the read-ahead after block {index}",
                )
                assert store.gets == len(fetched), (index, store.gets, sorted(fetched))
            nursery.cancel_scope.cancel()
    finally:
        cache.close()
    assert metrics.misses == 3  # block 0, and 30 and 31 after the jump


async def test_strided_readers_and_a_reader_without_the_service_get_no_read_ahead(world):
    reader, source, version, data, store, metrics = world
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        for index in (1, 3, 5):  # every other block, not from the start: not sequential
            assert (
                await reader.read(source, version, index * BLOCK, 10)
                == data[index * BLOCK : index * BLOCK + 10]
            )
        # A read-ahead started by these reads would have registered its fetch by now.
        await trio.testing.wait_all_tasks_blocked()
        assert reader.fetches_in_flight == 0
        nursery.cancel_scope.cancel()
    assert store.gets == 3 and metrics.readahead_blocks == 0
    # serve_readahead is not running: a sequential read fetches only what it reads.
    assert await reader.read(source, version, 0, 3 * BLOCK) == data[: 3 * BLOCK]
    assert await reader.read(source, version, 4 * BLOCK, 10) == data[4 * BLOCK : 4 * BLOCK + 10]
    assert reader.fetches_in_flight == 0
    assert store.gets == 6 and metrics.readahead_blocks == 0  # blocks 0, 2 and 4


async def test_run_in_thread_returns_the_value_and_raises_the_error_of_its_function():
    loop_thread = threading.get_ident()
    assert await run_in_thread(threading.get_ident, trio.CapacityLimiter(1)) != loop_thread

    def fails() -> None:
        raise StoreUnavailable("the store is down", dataset="ds", key="k", store="s")

    with pytest.raises(StoreUnavailable, match="the store is down"):
        await run_in_thread(fails, trio.CapacityLimiter(1))


async def test_run_in_thread_holds_a_token_of_its_limiter_until_the_function_is_done():
    limiter = trio.CapacityLimiter(1)
    release = threading.Event()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        release.wait(30)  # generous: set below once the second call is seen waiting

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_in_thread, first, limiter)
        await wait_until(lambda: ran == ["first"])
        nursery.start_soon(run_in_thread, lambda: ran.append("second"), limiter)
        await wait_until(lambda: limiter.statistics().tasks_waiting == 1)
        assert ran == ["first"] and limiter.borrowed_tokens == 1
        release.set()
    assert ran == ["first", "second"] and limiter.borrowed_tokens == 0


async def test_a_cancelled_run_in_thread_still_waits_for_its_function():
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []
    scopes: list[trio.CancelScope] = []

    def slow() -> None:
        started.set()
        release.wait(30)  # generous: set below once the cancel has been delivered
        finished.append("thread")

    async def hop() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await run_in_thread(slow, trio.CapacityLimiter(1))
        finished.append("task")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hop)
        await trio.to_thread.run_sync(started.wait, 30)
        scopes[0].cancel()
        await trio.sleep(0.05)
        assert finished == []  # cancelled, and still waiting for its thread
        release.set()
    assert finished == ["thread", "task"]
