"""The read path's use of the GET loop thread (cachefs/fs/blocks.py ``_get_in_loop``), over a
real TieredBlockCache and a real local store: what each outcome of a loop's try becomes. The
loop itself is replaced, below its seam (``LoopGets.submit``: a callback with the try's
outcome), by one that answers from a thread as the real one does; the real loop is tested in
tests/unit/store/test_get_thread.py, and the whole path against moto in
tests/e2e/fs/test_read_path.py."""

from __future__ import annotations

import threading

import pytest

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.errors import ObjectChanged
from cachefs.fs import blocks
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion, ReadLimits
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from cachefs.store.base import RetryPolicy
from tests.fakes.wrappers import CountingStore

BLOCK = 16 * 1024


class AnsweringLoop:
    """Answers every try with ``outcome`` (body, throttled), from a thread of its own."""

    running = True

    def __init__(self, outcome):
        self.outcome = outcome
        self.asked: list[tuple[str, int, int, str | None]] = []

    def submit(self, reader, key, offset, length, etag, done) -> None:
        self.asked.append((key, offset, length, etag))
        body, throttled = self.outcome(offset, length)
        threading.Thread(target=done, args=(body, throttled)).start()


class NoFreeSlot:
    """Admission slots that are never free at once (and free when waited for)."""

    def acquire(self, blocking: bool = True) -> bool:
        return blocking

    def release(self) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        pass


class Reader:
    retry = RetryPolicy()


@pytest.fixture
def world(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    data = bytes(range(256)) * (2 * BLOCK // 256) + b"tail"
    (source / "f.bin").write_bytes(data)
    store = CountingStore(open_store(StoreConfig(uri=f"file://{source}")))
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 1 << 20)]
    )
    metrics = WorkerMetrics()
    reader = BlockReader(cache, metrics, ReadLimits())
    reader._loop_reader = lambda _source, _length: Reader()  # every block: the loop's
    info = store.inner.head("f.bin")
    version = FileVersion(info.key, info.etag, info.size)
    yield reader, DataSource("ds", store, 1, BLOCK), version, data, store, metrics, cache
    cache.close()


def with_loop(reader: BlockReader, outcome) -> AnsweringLoop:
    loop = AnsweringLoop(outcome)
    reader._loop_gets = loop
    return loop


async def test_a_body_from_the_loop_is_served_and_admitted_without_the_store(world):
    reader, source, version, data, store, metrics, cache = world
    loop = with_loop(
        reader, lambda offset, length: (bytearray(data[offset : offset + length]), False)
    )
    assert await reader.read(source, version, 100, 2 * BLOCK) == data[100 : 2 * BLOCK + 100]
    assert store.gets == 0
    assert [asked[1:] for asked in loop.asked] == [
        (0, BLOCK, version.etag),
        (BLOCK, BLOCK, version.etag),
        (2 * BLOCK, 4, version.etag),
    ]
    assert metrics.store_gets_in_loop == 3
    assert all(cache.locate(reader.block_key(source, version, i)) == "ram" for i in range(3))
    assert await reader.read(source, version, 0, len(data)) == data  # from the cache now
    assert len(loop.asked) == 3


async def test_a_permanent_error_from_the_loop_is_the_read_error_with_its_dataset(world):
    reader, source, version, _data, store, metrics, _cache = world
    with_loop(reader, lambda offset, length: (ObjectChanged("the etag differs"), False))
    with pytest.raises(ObjectChanged) as raised:
        await reader.read(source, version, 0, 10)
    assert raised.value.dataset == "ds" and raised.value.key == version.key
    assert store.gets == 0
    assert metrics.store_request_counts()[("get", "ObjectChanged")] == 1


async def test_a_try_left_undone_and_throttled_is_read_on_a_thread_after_a_backoff(
    world, monkeypatch
):
    reader, source, version, data, store, metrics, cache = world
    backoffs: list[int] = []

    def backoff_s(policy, failures, jitter):
        backoffs.append(failures)
        return 0.0

    monkeypatch.setattr(blocks, "backoff_s", backoff_s)
    with_loop(reader, lambda offset, length: (None, True))
    assert await reader.read(source, version, 0, 10) == data[:10]
    assert store.gets == 1 and backoffs == [1]
    assert metrics.store_gets_in_loop == 0
    assert reader.store_concurrency.report()["throttled"] == 1
    assert cache.locate(reader.block_key(source, version, 0)) == "ram"


async def test_a_block_is_admitted_on_a_thread_when_no_slot_is_free_on_the_loops(world):
    reader, source, version, data, store, metrics, cache = world
    reader._admit_slots = NoFreeSlot()
    with_loop(reader, lambda offset, length: (bytearray(data[offset : offset + length]), False))
    assert await reader.read(source, version, 0, 10) == data[:10]
    assert store.gets == 0 and metrics.store_gets_in_loop == 1
    assert cache.locate(reader.block_key(source, version, 0)) == "ram"
