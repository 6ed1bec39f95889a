"""What enters the native READ table while the read-ahead runs: never a read-ahead marker
before a READ of it came to Python, so that the read-ahead sees the reader get there
(cachefs/fs/blocks.py, "markers"), whoever registers (a LOOKUP, a Python READ, a block fetched
ahead). A real FileSystem, NativeReads, BlockReader, TieredBlockCache, local store and
snapshot; the table itself, which lives in the patched pyfuse3, is a recorder below its seam
(NativeReadTable; the real one is tested in tests/unit/fs/test_native_table.py and through the
mounts of tests/e2e/fs/test_native_reads.py)."""

from __future__ import annotations

import random

import trio
import trio.testing

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.fs.blocks import BlockReader, DataSource, ReadLimits
from cachefs.fs.core import MOUNT_ROOT, FileSystem, MountedDataset
from cachefs.fs.native_reads import NativeReads
from cachefs.meta import Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from tests.fakes.native_table import RecordingTable
from tests.waiting import wait_until

BLOCK = 16 * 1024
MARKERS = {2, 5, 8, 11}  # of the batch the read of block 1 starts (blocks 2..13)


async def test_markers_enter_the_native_table_only_after_a_read_of_them(tmp_path):
    source_dir = tmp_path / "source"
    source_dir.mkdir()
    data = random.Random(7).randbytes(40 * BLOCK)
    (source_dir / "long.bin").write_bytes(data)
    store = open_store(StoreConfig(uri=f"file://{source_dir}"))
    build_snapshot(store.list(), tmp_path / "snapshot")
    snapshot = Snapshot.open(tmp_path / "snapshot")
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 4 << 20)]
    )
    reader = BlockReader(cache, WorkerMetrics(), ReadLimits())
    fs = FileSystem(reader)
    fs.add_dataset(MountedDataset("ds", 1, snapshot, DataSource("ds", store, 1, BLOCK)))
    table = RecordingTable()
    fs.native = NativeReads(table, cache, reader)  # type: ignore[arg-type]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve_readahead)
            root = fs.lookup(MOUNT_ROOT, b"ds").ino
            ino = fs.lookup(root, b"long.bin").ino
            assert table.registered == []  # nothing cached yet

            async def read(index: int, read_ahead: int) -> None:
                """Read block ``index``; wait until ``read_ahead`` blocks were fetched ahead."""
                got = await fs.read_inode(ino, index * BLOCK, BLOCK)
                assert got == data[index * BLOCK : (index + 1) * BLOCK]
                await wait_until(lambda: reader.metrics.readahead_blocks == read_ahead)
                await trio.testing.wait_all_tasks_blocked()

            await read(0, 1)  # block 0 goes in; block 1, fetched ahead, is the marker
            assert table.registered == [0]
            await read(1, 13)  # the marker's READ: 2..13 fetched ahead
            assert set(table.registered) & MARKERS == set()
            # Block 1 after its READ, and the others when fetched.
            assert set(table.registered) == {0, 1, 3, 4, 6, 7, 9, 10, 12, 13}
            # A LOOKUP again while the file is read (the dentry dropped) stops before them too.
            table.registered.clear()
            fs.lookup(root, b"long.bin")
            assert table.registered == [0, 1]
            table.registered.clear()
            await read(2, 14)  # marker 2 read: it and the blocks up to the next marker go in
            assert table.registered == [2, 3, 4]
            nursery.cancel_scope.cancel()
    finally:
        snapshot.close()
        cache.close()
        store.close()
