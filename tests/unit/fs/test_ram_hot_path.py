"""The RAM-tier read path below FUSE: a RAM-tier hit costs one index lookup, a block's key is
computed once, and no-open reads take the file version from a map that LOOKUP fills — which
must follow refreshes and dataset removals, or a changed file would be served its old bytes
from the RAM tier. Real TieredBlockCache, real local store, real snapshots; the cache is only
wrapped to count the calls made across its interface."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

import cachefs.fs.core as core_module
from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey
from cachefs.errors import PathNotFound
from cachefs.fs.blocks import BlockReader, DataSource
from cachefs.fs.core import MOUNT_ROOT, FileSystem, MountedDataset
from cachefs.meta import Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from tests.fakes.wrappers import CountingStore

BLOCK = 16 * 1024


class CountingCache:
    """Delegates to a real cache; counts calls by (method, tier argument)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: Counter[tuple[str, str | None]] = Counter()

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.calls[name, kwargs.get("tier")] += 1
            return method(*args, **kwargs)

        return counted


class World:
    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.source_dir = tmp_path / "source"
        self.source_dir.mkdir()
        rng = random.Random(3)
        self.files = {
            "one.bin": rng.randbytes(BLOCK - 100),
            "two.bin": rng.randbytes(BLOCK + 500),
            "d/small.bin": rng.randbytes(300),
        }
        for name, data in self.files.items():
            self.write(name, data)
        self.store = CountingStore(open_store(StoreConfig(uri=f"file://{self.source_dir}")))
        self.source = DataSource("ds", self.store, 1, BLOCK)
        self.snapshots = 0
        self.cache = TieredBlockCache(
            str(tmp_path / "index"),
            [
                # two.bin fills it exactly: what is admitted after it goes to the SSD tier
                TierConfig("ram", str(tmp_path / "ram"), BLOCK + 500),
                TierConfig("ssd", str(tmp_path / "ssd"), 8 * BLOCK),
            ],
        )
        self.counted = CountingCache(self.cache)
        self.metrics = WorkerMetrics()
        self.fs = FileSystem(BlockReader(self.counted, self.metrics))
        self.fs.add_dataset(MountedDataset("ds", 1, self.new_snapshot(), self.source))

    def write(self, name: str, data: bytes) -> None:
        path = self.source_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def new_snapshot(self, previous: Snapshot | None = None) -> Snapshot:
        self.snapshots += 1
        dest = self.tmp_path / f"snapshot{self.snapshots}"
        build_snapshot(self.store.inner.list(), dest, previous=previous)
        return Snapshot.open(dest)

    def ino(self, path: str) -> int:
        """The inode of ``path`` under the dataset, by LOOKUPs as the kernel sends them."""
        ino = self.fs.lookup(MOUNT_ROOT, b"ds").ino
        for part in path.split("/"):
            ino = self.fs.lookup(ino, part.encode()).ino
        return ino

    def etag(self, name: str) -> str:
        return next(info.etag for info in self.store.inner.list() if info.key == name)

    async def read_all(self, ino: int, size: int, step: int = 4096) -> bytes:
        return b"".join([await self.fs.read_inode(ino, o, step) for o in range(0, size, step)])

    def close(self) -> None:
        for dataset in self.fs.datasets():
            dataset.snapshot.close()
        self.cache.close()


@pytest.fixture
def world(tmp_path):
    world = World(tmp_path)
    yield world
    world.close()


async def test_a_ram_tier_hit_is_one_index_lookup(world):
    ino = world.ino("one.bin")
    data = world.files["one.bin"]
    assert await world.read_all(ino, len(data)) == data  # fetched, admitted to RAM
    assert world.cache.locate(BlockKey.make(1, "one.bin", world.etag("one.bin"), 0)) == "ram"
    world.counted.calls.clear()
    gets, hits = world.store.gets, world.metrics.hits["ram"]

    assert await world.read_all(ino, len(data), step=1000) == data
    reads = (len(data) + 999) // 1000
    assert world.counted.calls == {("read", "ram"): reads}  # no locate, no second lookup
    assert world.metrics.hits["ram"] == hits + reads
    assert world.store.gets == gets


async def test_an_ssd_tier_hit_is_read_after_the_ram_tier_says_no(world):
    data = world.files["two.bin"]  # two blocks, which fill the RAM tier
    assert await world.read_all(world.ino("two.bin"), len(data)) == data
    small = world.files["d/small.bin"]
    ino = world.ino("d/small.bin")
    assert await world.fs.read_inode(ino, 0, 4096) == small  # admitted to the SSD tier
    world.counted.calls.clear()
    gets = world.store.gets

    assert await world.fs.read_inode(ino, 100, 50) == small[100:150]
    assert world.counted.calls == {("read", "ram"): 1, ("locate", None): 1, ("read", None): 1}
    assert world.metrics.hits["ssd"] == 1
    assert world.store.gets == gets


async def test_a_blocks_key_is_computed_once_for_all_its_reads(world, monkeypatch):
    made = Counter()
    real_make = BlockKey.make.__func__

    def counting_make(cls, source_id, object_key, etag, index):
        made[object_key, index] += 1
        return real_make(cls, source_id, object_key, etag, index)

    monkeypatch.setattr(BlockKey, "make", classmethod(counting_make))
    data = world.files["two.bin"]
    ino = world.ino("two.bin")
    for _ in range(3):
        assert await world.read_all(ino, len(data), step=1000) == data
    assert made == {("two.bin", 0): 1, ("two.bin", 1): 1}


async def test_reads_after_a_lookup_decode_no_snapshot_entry(world, monkeypatch):
    dataset_ino = world.fs.lookup(MOUNT_ROOT, b"ds").ino
    decoded = Counter()
    real_getattr = Snapshot.getattr

    def counting_getattr(snapshot, ino):
        decoded[ino] += 1
        return real_getattr(snapshot, ino)

    monkeypatch.setattr(Snapshot, "getattr", counting_getattr)
    data = world.files["two.bin"]
    ino = world.fs.lookup(dataset_ino, b"two.bin").ino  # what the kernel sends first
    for _ in range(2):
        assert await world.read_all(ino, len(data)) == data
    assert decoded == {}
    # An inode read without a LOOKUP in this process (after a worker restart, the kernel
    # still knows it) is decoded once.
    world.fs.replace_snapshot("ds", world.fs.dataset("ds").snapshot, world.source)
    for _ in range(2):
        assert await world.read_all(ino, len(data)) == data
    assert decoded == {ino & core_module.LOCAL_MASK: 1}


async def test_a_refresh_gives_new_bytes_a_new_inode_and_the_old_one_keeps_its_bytes(world):
    """The kernel keeps pages per inode: a changed file's new inode never shares them with the
    old one, which a process holding the file open goes on reading (old bytes, from the RAM
    tier) once the refresh retired it. A removed file that was not retired is gone."""
    old = world.files["one.bin"]
    ino = world.ino("one.bin")
    removed_ino = world.ino("d/small.bin")
    assert await world.read_all(ino, len(old)) == old  # its block is now in the RAM tier
    assert await world.fs.read_inode(removed_ino, 0, 10) == world.files["d/small.bin"][:10]

    new = bytes(reversed(old))  # same size; a new mtime gives a new etag
    world.write("one.bin", new)
    os.utime(world.source_dir / "one.bin", ns=(1, 1))
    os.unlink(world.source_dir / "d/small.bin")
    previous = world.fs.dataset("ds").snapshot
    refreshed = world.new_snapshot(previous=previous)
    retired = [previous.getattr(ino & core_module.LOCAL_MASK)]  # as datasets.py names them
    world.fs.replace_snapshot("ds", refreshed, world.source, retired).close()

    new_ino = world.ino("one.bin")
    assert new_ino != ino
    assert await world.read_all(new_ino, len(new)) == new
    assert await world.read_all(ino, len(old)) == old
    assert world.fs.getattr(ino).size == len(old)
    with pytest.raises(PathNotFound):
        await world.fs.read_inode(removed_ino, 0, 10)


async def test_retired_entries_are_bounded_and_go_with_their_dataset(world, monkeypatch):
    """At most RETIRED_KEPT retired files stay readable, the oldest forgotten first; removing
    the dataset forgets its retired files at once."""
    monkeypatch.setattr(core_module, "RETIRED_KEPT", 1)
    one, small = world.ino("one.bin"), world.ino("d/small.bin")
    assert await world.fs.read_inode(small, 0, 10) == world.files["d/small.bin"][:10]  # cached
    previous = world.fs.dataset("ds").snapshot
    entries = [previous.getattr(ino & core_module.LOCAL_MASK) for ino in (one, small)]
    os.unlink(world.source_dir / "one.bin")
    os.unlink(world.source_dir / "d/small.bin")
    refreshed = world.new_snapshot(previous=previous)
    world.fs.replace_snapshot("ds", refreshed, world.source, entries).close()

    with pytest.raises(PathNotFound):
        world.fs.getattr(one)  # the older of the two, past the bound
    assert world.fs.getattr(small).size == len(world.files["d/small.bin"])
    assert await world.fs.read_inode(small, 0, 10) == world.files["d/small.bin"][:10]  # cache

    removed = world.fs.remove_dataset("ds")
    # Mounted again under the same slot (only here: the registry never reuses one), from a
    # snapshot of the same lineage, which gives small.bin's old inode to no file.
    again = world.new_snapshot(previous=removed.snapshot)
    removed.snapshot.close()
    world.fs.add_dataset(MountedDataset("ds", 1, again, world.source))
    with pytest.raises(PathNotFound):
        world.fs.getattr(small)


async def test_a_removed_dataset_serves_nothing_and_a_new_one_serves_its_own_files(world):
    data = world.files["one.bin"]
    ino = world.ino("one.bin")
    assert await world.fs.read_inode(ino, 0, 10) == data[:10]

    world.fs.remove_dataset("ds").snapshot.close()
    with pytest.raises(PathNotFound):
        await world.fs.read_inode(ino, 0, 10)
    world.fs.add_dataset(MountedDataset("ds", 2, world.new_snapshot(), world.source))
    new_ino = world.ino("one.bin")
    assert new_ino != ino
    assert await world.fs.read_inode(new_ino, 0, 10) == data[:10]
    with pytest.raises(PathNotFound):
        await world.fs.read_inode(ino, 0, 10)


async def test_the_version_map_stays_bounded_and_reads_stay_right(world, monkeypatch):
    monkeypatch.setattr(core_module, "VERSIONS_KEPT", 2)
    for round_no in range(2):
        for name, data in world.files.items():
            ino = world.ino(name)
            assert await world.read_all(ino, len(data)) == data, (round_no, name)
            assert len(world.fs._versions) <= 2
