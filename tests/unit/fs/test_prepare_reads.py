"""FileSystem.prepare_reads: what a preload leaves in the native table for the files it fetched,
so that a job's first LOOKUP and READ of each are answered in C. A real FileSystem, NativeReads,
BlockReader, TieredBlockCache, local store and snapshot; the binding's table is a recorder below
its seam (NativeReadTable: the real one is tested in tests/unit/fs/test_native_table.py, and a
preloaded dataset read through a real mount in tests/e2e/cluster/test_local_preload.py)."""

from __future__ import annotations

import random

import trio

from cachefs import datasets
from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.fs.blocks import BlockReader, DataSource, ReadLimits
from cachefs.fs.core import MOUNT_ROOT, Attr, FileSystem, MountedDataset
from cachefs.fs.native_reads import NativeReads
from cachefs.meta import Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.store import StoreConfig, open_store
from tests.fakes.native_table import RecordingTable

BLOCK = 16 * 1024


async def test_prepared_files_get_their_lookup_reply_and_their_cached_blocks(tmp_path):
    rng = random.Random(5)
    files = {
        "a/two.bin": rng.randbytes(BLOCK + 10),  # 2 blocks, both cached below
        "a/cold.bin": rng.randbytes(100),  # never read: its LOOKUP reply only
        "top.bin": rng.randbytes(BLOCK),
    }
    source_dir = tmp_path / "source"
    for key, data in files.items():
        (source_dir / key).parent.mkdir(parents=True, exist_ok=True)
        (source_dir / key).write_bytes(data)
    store = open_store(StoreConfig(uri=f"file://{source_dir}"))
    build_snapshot(store.list(), tmp_path / "snapshot")
    snapshot = Snapshot.open(tmp_path / "snapshot")
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 4 << 20)]
    )
    reader = BlockReader(cache, WorkerMetrics(), ReadLimits(readahead_growth=0))
    fs = FileSystem(reader)
    fs.add_dataset(MountedDataset("ds", 1, snapshot, DataSource("ds", store, 1, BLOCK)))
    replies: list[tuple[int, bytes, Attr]] = []
    try:
        assert fs.prepare_reads("ds", list(files), 100) == (0, 0)  # no native path
        table = RecordingTable()
        fs.native = NativeReads(table, cache, reader)  # type: ignore[arg-type]
        fs.lookup_prepared = lambda parent, name, attr: replies.append((parent, name, attr))

        root = fs.lookup(MOUNT_ROOT, b"ds").ino
        a = fs.lookup(root, b"a").ino
        two, top = fs.lookup(a, b"two.bin").ino, fs.lookup(root, b"top.bin").ino
        for ino, data in ((two, files["a/two.bin"]), (top, files["top.bin"])):
            for offset in range(0, len(data), BLOCK):  # cold reads: admitted to the RAM tier
                assert await fs.read_inode(ino, offset, BLOCK) == data[offset : offset + BLOCK]
        await trio.sleep(0)
        table.blocks.clear()

        asked = ["a/two.bin", "a/cold.bin", "top.bin", "a", "missing.bin", "a/two.bin/x"]
        # The three files (not a directory or a miss), and their cached blocks.
        assert fs.prepare_reads("ds", asked, 100) == (3, 3)
        assert sorted(table.blocks) == sorted([(two, 0), (two, 1), (top, 0)])
        # Each reply is the one a LOOKUP of that name gives, under the directory it is in.
        expected = [
            (a, b"two.bin", fs.lookup(a, b"two.bin")),
            (a, b"cold.bin", fs.lookup(a, b"cold.bin")),
            (root, b"top.bin", fs.lookup(root, b"top.bin")),
        ]
        assert replies == expected
        assert fs.prepare_reads("other", ["top.bin"], 100) == (0, 0)  # no such dataset

        # Past the block budget the files get their LOOKUP replies only.
        table.blocks.clear()
        replies.clear()
        assert fs.prepare_reads("ds", ["a/two.bin", "top.bin"], 1) == (2, 1)
        assert table.blocks == [(two, 0)] and len(replies) == 2
    finally:
        cache.close()
        snapshot.close()
        store.close()


async def test_batches_stay_within_the_caps_and_a_failure_only_ends_them(monkeypatch):
    """DatasetManager.prepare_reads's loop (prepare_in_batches) over a recording prepare."""
    monkeypatch.setattr(datasets, "PREPARE_BATCH", 3)
    monkeypatch.setattr(datasets, "PREPARED_FILES_MAX", 8)
    monkeypatch.setattr(datasets, "PREPARED_BLOCKS_MAX", 5)
    calls: list[tuple[list[str], int]] = []

    def prepare(dataset: str, keys, max_blocks: int) -> tuple[int, int]:
        calls.append((list(keys), max_blocks))
        return len(keys), min(2, max_blocks)  # two blocks registered while the budget allows

    keys = [f"f{i}" for i in range(20)]
    assert await datasets.prepare_in_batches(prepare, "ds", keys) == 8  # the file cap
    assert calls == [(["f0", "f1", "f2"], 5), (["f3", "f4", "f5"], 3), (["f6", "f7"], 1)]

    def failing(dataset: str, keys, max_blocks: int) -> tuple[int, int]:
        if keys[0] == "f3":
            raise RuntimeError("LMDB out of readers")
        return len(keys), 0

    assert await datasets.prepare_in_batches(failing, "ds", keys) == 3  # the first batch
