"""The block read path below FUSE: BlockReader over a real TieredBlockCache and a real local
store. The store is wrapped (below SEAM A, whose real implementations have their own tests) only
to count and slow down requests, so that concurrent misses really overlap."""

from __future__ import annotations

import os
import random

import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.errors import StoreUnavailable
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion, ReadLimits
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from tests.fakes.wrappers import CountingStore

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
    """Reading on from block 0 into block 1 starts fetches of blocks 2..5 in the background:
    the reader then finds them cached or in flight, each block is fetched once, and the
    bytes are the file's."""
    reader, source, version, data, store, metrics = world
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        step = BLOCK // 4
        got = await read_in_steps(reader, source, version, range(0, 2 * BLOCK, step), step)
        await trio.sleep(0.5)  # the read-ahead fetches (0.2 s each, in parallel) finish
        assert store.gets == 6  # blocks 0 and 1 on demand, 2..5 ahead: every block once
        assert metrics.readahead_blocks == 4
        got += await read_in_steps(reader, source, version, range(2 * BLOCK, len(data), step), step)
        nursery.cancel_scope.cancel()
    assert got == data
    assert store.gets == 6 and metrics.misses == 2


async def test_strided_readers_and_a_reader_without_the_service_get_no_read_ahead(world):
    reader, source, version, data, store, metrics = world
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.serve_readahead)
        for index in (0, 2, 4):  # every other block: not sequential
            assert (
                await reader.read(source, version, index * BLOCK, 100)
                == data[index * BLOCK : index * BLOCK + 100]
            )
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()
    assert store.gets == 3 and metrics.readahead_blocks == 0
    # serve_readahead is not running: a sequential read fetches only what it reads.
    assert await reader.read(source, version, BLOCK, 2 * BLOCK) == data[BLOCK : 3 * BLOCK]
    assert await reader.read(source, version, 3 * BLOCK, 10) == data[3 * BLOCK : 3 * BLOCK + 10]
    await trio.sleep(0.3)
    assert store.gets == 5 and metrics.readahead_blocks == 0
