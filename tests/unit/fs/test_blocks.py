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
    """A first read at offset 0 fetches block 1 ahead; each read in order then widens the window
    (16 times the bytes read in order: a quarter block read puts 4 blocks ahead), so within
    block 0 every block of the file is fetched ahead: the reader then finds them cached or in
    flight, each block is fetched once, and the bytes are the file's."""
    reader, source, version, data, store, metrics = world
    step = BLOCK // 4
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        got = await reader.read(source, version, 0, step)
        await wait_until(lambda: metrics.readahead_blocks == 1, "block 1 read ahead")
        got += await read_in_steps(reader, source, version, range(step, BLOCK, step), step)
        await wait_until(lambda: metrics.readahead_blocks == 5, "blocks 2..5 read ahead")
        assert store.gets == 6  # block 0 on demand, 1..5 ahead: every block once
        got += await read_in_steps(reader, source, version, range(BLOCK, len(data), step), step)
        nursery.cancel_scope.cancel()
    assert got == data
    assert store.gets == 6 and metrics.misses == 1


def long_file_world(tmp_path, blocks: int, limits: ReadLimits):
    source_dir = tmp_path / "source"
    source_dir.mkdir()
    data = random.Random(9).randbytes(blocks * BLOCK)
    (source_dir / "long.bin").write_bytes(data)
    store = CountingStore(open_store(StoreConfig(uri=f"file://{source_dir}")), delay_s=0.01)
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 4 << 20)]
    )
    reader = BlockReader(cache, WorkerMetrics(), limits)
    info = store.inner.head("long.bin")
    version = FileVersion(info.key, info.etag, info.size)
    return reader, DataSource("ds", store, 1, BLOCK), version, data, store, cache


async def follow_model(reader, source, version, data, store, model) -> None:
    """Read each (first block, blocks) of ``model`` whole; after each, wait for the read-ahead
    it started and check that the store was asked for every block up to its ``highest`` once
    (the count starts from the store's GETs so far)."""
    fetched: set[int] = set()
    already = store.gets
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        for index, count, highest in model:
            got = await reader.read(source, version, index * BLOCK, count * BLOCK)
            assert got == data[index * BLOCK : (index + count) * BLOCK]
            fetched |= set(range(index, highest + 1))
            await wait_until(
                lambda n=len(fetched): store.gets >= already + n and reader.fetches_in_flight == 0,
                f"the read-ahead after block {index}",
            )
            assert store.gets == already + len(fetched), (index, store.gets, sorted(fetched))
        nursery.cancel_scope.cancel()


async def test_the_read_ahead_window_grows_with_the_bytes_read_in_order_and_restarts_after_a_jump(
    tmp_path,
):
    """Reference model, growth 2 and at most 8 blocks: a first read at 0 fetches block 1; after
    N blocks read in order the window is 2N blocks past the block read, at most 8; a jump
    starts a new stream that fetches nothing until it reads on in order. So the store's GET
    count is exactly the blocks reached."""
    world = long_file_world(tmp_path, 40, ReadLimits(readahead_growth=2, readahead_max_blocks=8))
    reader, source, version, data, store, cache = world
    # (block read, blocks read, the highest block fetched once its read-ahead is done)
    model = [
        (0, 1, 1), (1, 1, 3), (2, 1, 6), (3, 1, 9), (4, 1, 12), (5, 1, 13),
        (30, 1, 30), (31, 1, 33), (32, 1, 36),
    ]  # fmt: skip
    try:
        await follow_model(reader, source, version, data, store, model)
    finally:
        cache.close()
    assert reader.metrics.misses == 3  # block 0, and 30 and 31 after the jump


async def test_reads_the_native_path_served_in_between_keep_a_stream_in_order(tmp_path):
    """Blocks fetched ahead are answered by the native READ path without reaching Python: a
    read that starts past where the stream ended is still in order up to the first marker not
    read yet (a marker's READ always comes here); one past it skipped it: a jump. A read at
    offset 0 starts the stream again, as a first read (a file read once more)."""
    world = long_file_world(tmp_path, 40, ReadLimits())  # growth 16, at most 12 blocks
    reader, source, version, data, store, cache = world
    model = [
        (0, 1, 1),  # a first read: block 1 ahead, a marker
        (1, 1, 13),  # the marker: 12 ahead (2..13), markers 2, 5, 8 and 11
        (2, 1, 14),  # the marker 2: one more (14, a marker)
        (5, 1, 17),  # 3 and 4 read natively, then the marker 5: 15..17
        (9, 1, 17),  # past marker 8, never read: a jump, nothing ahead
    ]
    try:
        await follow_model(reader, source, version, data, store, model)
        cache.evict_source(source.source_id)  # as after `dataset rm` and `dataset add`
        gets = store.gets
        await follow_model(reader, source, version, data, store, [(0, 1, 1)])
        assert store.gets == gets + 2  # block 0, and block 1 ahead again
    finally:
        cache.close()


async def test_read_ahead_markers_are_left_out_of_the_native_table_until_read(tmp_path):
    """The blocks fetched ahead are reported (for the native table) when fetched, except the
    markers, one in every quarter of the window from each batch's first: those stay out until
    a read of them comes to Python, which also moves the window on."""
    world = long_file_world(tmp_path, 40, ReadLimits(readahead_growth=16, readahead_max_blocks=8))
    reader, source, version, _data, store, cache = world
    reported: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve_readahead)
            await reader.read(source, version, 0, BLOCK, read_ahead_done=reported.append)
            await wait_until(lambda: reader.fetches_in_flight == 0 and store.gets == 2)
            assert reported == []  # block 1, the first batch's only block, is a marker
            assert reader.next_marker(source, version, 0) == 1
            await reader.read(source, version, BLOCK, BLOCK, read_ahead_done=reported.append)
            await wait_until(lambda: reader.fetches_in_flight == 0 and store.gets == 10)
            # Blocks 2..9 ahead (window 8), markers 2, 4, 6 and 8.
            assert sorted(reported) == [3, 5, 7, 9]
            assert reader.next_marker(source, version, 1) == 2
            assert reader.next_marker(source, version, 5) == 6
            assert reader.next_marker(source, version, 9) is None
            await reader.read(source, version, 2 * BLOCK, 3 * BLOCK)  # blocks 2..4: past 2 and 4
            assert reader.next_marker(source, version, 1) == 6
            nursery.cancel_scope.cancel()
    finally:
        cache.close()


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
    reader.cache.evict_source(source.source_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        # Every other block from the start: block 1 ahead of the first read, a marker, which
        # the read of block 2 skipped: a jump, and so is the read of block 4.
        for index in (0, 2, 4):
            assert (
                await reader.read(source, version, index * BLOCK, 10)
                == data[index * BLOCK : index * BLOCK + 10]
            )
        await wait_until(lambda: reader.fetches_in_flight == 0 and store.gets == 7)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert store.gets == 7 and metrics.readahead_blocks == 1  # blocks 0, 1 (ahead), 2 and 4
    reader.cache.evict_source(source.source_id)
    # serve_readahead is not running: a sequential read fetches only what it reads.
    assert await reader.read(source, version, 0, 3 * BLOCK) == data[: 3 * BLOCK]
    assert await reader.read(source, version, 4 * BLOCK, 10) == data[4 * BLOCK : 4 * BLOCK + 10]
    assert reader.fetches_in_flight == 0
    assert store.gets == 11 and metrics.readahead_blocks == 1  # blocks 0, 1, 2 and 4 again


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
