"""Short-circuit reads and prefetch hints: a real `cachefs up` worker process, a real FUSE mount,
moto S3 behind the fault proxy (which counts the GETs that reach the store), and the
short-circuit reader of tf_dataset (no TensorFlow needed)."""

from __future__ import annotations

import os
import random
from functools import partial

import pytest

from cachefs.client import ControlClient, ControlError
from cachefs.fs.prefetch import Prefetcher
from tests.damage import flip_byte
from tests.waiting import wait_for
from tests.worker_process import WorkerProcess, drop_page_cache, start_s3_world
from tf_dataset.reader import CachedBlock, FileLayout, ShortCircuitReader, read_block_file

BLOCK = 64 * 1024


def make_objects(seed: int = 11) -> dict[str, bytes]:
    rng = random.Random(seed)
    sizes = {
        "empty.bin": 0,
        "small/a.jpg": 1_000,
        "small/b.jpg": BLOCK,
        "small/c.jpg": BLOCK + 1,
        "multi/blocks.bin": 5 * BLOCK + 77,
        "train/n01/x.jpg": 110_000,
        "train/n02/y.jpg": 95_000,
    }
    return {key: rng.randbytes(size) for key, size in sizes.items()}


@pytest.fixture
def world(moto_s3, fault_proxy, tmp_path):
    world = start_s3_world(moto_s3, fault_proxy, str(tmp_path), make_objects(), block_size=BLOCK)
    world.reader = ShortCircuitReader("ds", state_dir=world.worker.state)
    yield world
    world.reader.close()
    world.worker.cleanup()


def read_through_mount(worker: WorkerProcess, key: str) -> bytes:
    with open(worker.path("ds", key), "rb") as f:
        return f.read()


def blocks_of(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK


def test_batch_resolve_of_cached_files_reads_back_byte_exact_without_fuse(world):
    worker, objects, reader = world.worker, world.objects, world.reader
    for key in objects:
        read_through_mount(worker, key)
    paths = sorted(objects)
    *layouts, missing, directory = reader.resolve([*paths, "no/such/file", "train"])
    assert missing is None and directory is None
    for path, layout in zip(paths, layouts, strict=True):
        assert layout.path == path and layout.size == len(objects[path])
        assert len(layout.blocks) == blocks_of(len(objects[path]))
        assert layout.local, path
        for index, block in enumerate(layout.blocks):
            assert block.file.startswith(worker.ram_dir)  # a file in the RAM tier, not the mount
            assert read_block_file(block) == objects[path][index * BLOCK : (index + 1) * BLOCK]
    gets = world.proxy.count("GET")
    reads_before = worker.status()["reads"]
    for path, layout in zip(paths, layouts, strict=True):
        assert reader.read(path, layout) == objects[path], path
    stats = reader.stats.as_dict()
    assert stats["short_circuit_files"] == len(paths)
    assert stats["mount_files"] == stats["fallback_files"] == 0
    reads_after = worker.status()["reads"]
    assert reads_after["hits"] == reads_before["hits"], "short-circuit reads went through FUSE"
    assert world.proxy.count("GET") == gets


def test_resolve_of_uncached_files_says_so_and_the_reader_uses_the_mount(world):
    worker, objects, reader = world.worker, world.objects, world.reader
    answer = worker.client.resolve_many("ds", ["train/n01/x.jpg", "multi/blocks.bin"])
    assert answer["mount_root"] == os.path.join(worker.mount, "ds")
    assert answer["block_size"] == BLOCK
    assert [f["blocks"] for f in answer["files"]] == [[None, None], [None] * 6]
    single = worker.client.resolve("ds", "train/n01/x.jpg")
    assert [b["file"] for b in single["blocks"]] == [None, None]
    layout = reader.resolve(["train/n01/x.jpg"])[0]
    assert not layout.local
    assert reader.read("train/n01/x.jpg", layout) == objects["train/n01/x.jpg"]
    assert reader.stats.as_dict()["mount_files"] == 1
    # The mount read cached it: now it resolves to block files with the checksums they carry.
    again = worker.client.resolve("ds", "train/n01/x.jpg")["blocks"]
    assert all(b["file"] and len(b["checksum"]) == 16 for b in again)


def test_prefetch_hint_fetches_uncached_files_so_later_reads_skip_the_store(world):
    worker, objects, proxy = world.worker, world.objects, world.proxy
    hinted = ["train/n01/x.jpg", "train/n02/y.jpg", "multi/blocks.bin", "small/c.jpg"]
    expected_blocks = sum(blocks_of(len(objects[p])) for p in hinted)
    proxy.reset_counts()
    answer = worker.client.prefetch("ds", [*hinted, "no/such/file"])
    assert answer["accepted"] == len(hinted) + 1 and answer["dropped"] == 0

    def prefetched() -> bool:
        counters = worker.status()["prefetch"]
        return counters["blocks_fetched"] + counters["blocks_failed"] >= expected_blocks

    wait_for(prefetched, "the hinted blocks to be fetched")
    counters = worker.status()["prefetch"]
    assert counters["blocks_fetched"] == expected_blocks and counters["blocks_failed"] == 0
    assert counters["hinted_files"] == len(hinted) + 1
    wait_for(lambda: worker.status()["prefetch"]["unknown_files"] == 1, "the unknown path")
    assert proxy.count("GET", path_contains="/ds/") == expected_blocks
    # Every hinted file now resolves to local block files, and reading it through the mount
    # does not reach the store.
    layouts = world.reader.resolve(hinted)
    assert all(layout.local for layout in layouts)
    drop_page_cache()
    for path in hinted:
        assert read_through_mount(worker, path) == objects[path]
    assert proxy.count("GET", path_contains="/ds/") == expected_blocks
    # A hint for cached files fetches nothing.
    worker.client.prefetch("ds", hinted)
    wait_for(
        lambda: worker.status()["prefetch"]["blocks_cached"] >= expected_blocks,
        "the second hint to be processed",
    )
    assert proxy.count("GET", path_contains="/ds/") == expected_blocks
    metrics = worker.client.metrics()
    assert f"cachefs_prefetch_hinted_files_total {2 * len(hinted) + 1}.0" in metrics
    assert 'cachefs_prefetch_blocks_total{outcome="fetched"}' in metrics


def test_prefetch_and_resolve_refuse_unknown_datasets_and_oversized_batches(world):
    client = world.worker.client
    for call in (client.prefetch, client.resolve_many):
        with pytest.raises(ControlError) as missing:
            call("nope", ["a"])
        assert missing.value.status == 404
        with pytest.raises(ControlError) as too_many:
            call("ds", ["a"] * 10_001)
        assert too_many.value.status == 400


def test_damaged_or_missing_block_files_fall_back_to_the_mount_with_exact_bytes(world):
    worker, objects, reader = world.worker, world.objects, world.reader
    damaged = {
        "train/n01/x.jpg": partial(flip_byte, offset=0),  # same length, wrong checksum
        "train/n02/y.jpg": os.unlink,  # evicted behind the reader's back
        "multi/blocks.bin": lambda path: os.truncate(path, os.path.getsize(path) // 2),
        "small/a.jpg": partial(flip_byte, offset=-1),
    }
    for key in damaged:
        read_through_mount(worker, key)
    layouts = dict(zip(damaged, reader.resolve(list(damaged)), strict=True))
    for key, damage in damaged.items():
        damage(layouts[key].blocks[-1].file)
    drop_page_cache()
    for key in damaged:
        assert reader.read(key, layouts[key]) == objects[key], key
    stats = reader.stats.as_dict()
    assert stats["fallback_files"] == len(damaged) and stats["short_circuit_files"] == 0
    # A file read back by the worker is whole again, and short-circuits once resolved anew.
    fresh = reader.resolve(list(damaged))
    for key, layout in zip(damaged, fresh, strict=True):
        assert layout.local and reader.read(key, layout) == objects[key]
    assert reader.stats.as_dict()["short_circuit_files"] == len(damaged)


def test_reader_without_a_worker_reads_through_the_mount_root(tmp_path):
    root = tmp_path / "mount" / "ds"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.bin").write_bytes(b"payload")
    client = ControlClient(str(tmp_path / "no-worker-state"))
    reader = ShortCircuitReader("ds", client=client, mount_root=str(root))
    try:
        assert reader.resolve(["d/f.bin"]) == [None]
        assert reader.hint(["d/f.bin"]) is False
        assert reader.read("d/f.bin", None) == b"payload"
        # A layout whose block file is gone: the mount, never an error.
        gone = FileLayout("d/f.bin", 7, (CachedBlock(str(tmp_path / "gone"), 7, 0),))
        assert reader.read("d/f.bin", gone) == b"payload"
        stats = reader.stats.as_dict()
        assert stats["resolve_errors"] == 1 and stats["hint_errors"] == 1
        assert stats["mount_files"] == 2 and stats["fallback_files"] == 1
    finally:
        reader.close()


def test_read_block_file_checks_length_and_checksum(tmp_path):
    import xxhash

    data = os.urandom(5000)
    path = tmp_path / "block"
    path.write_bytes(data)
    good = CachedBlock(str(path), len(data), xxhash.xxh3_64_intdigest(data))
    assert read_block_file(good) == data
    assert read_block_file(CachedBlock(str(path), len(data), good.checksum ^ 1)) is None
    assert read_block_file(CachedBlock(str(path), len(data) - 1, good.checksum)) is None
    assert read_block_file(CachedBlock(str(path), len(data) + 1, good.checksum)) is None
    # Bytes appended after the block do not change the block's bytes: still served, exactly.
    with open(path, "ab") as f:
        f.write(b"tail")
    assert read_block_file(good) == data


def test_prefetch_queue_keeps_the_newest_hints_and_counts_the_dropped():
    prefetcher = Prefetcher(None, None, evicts=False, max_queued=3, concurrency=1)
    answer = prefetcher.hint("ds", ["a", "b"])
    assert answer == {"accepted": 2, "dropped": 0, "queued": 2}
    answer = prefetcher.hint("ds", ["c", "d", "e"])
    assert answer == {"accepted": 3, "dropped": 2, "queued": 3}
    assert list(prefetcher._queue) == [("ds", "c"), ("ds", "d"), ("ds", "e")]
    status = prefetcher.status()
    assert status["hinted_files"] == 5 and status["dropped_files"] == 2
    assert status["queued_files"] == 3


def test_block_file_names_the_admitted_file_with_its_size_and_checksum(tmp_path):
    from cachefs.cache import TierConfig, TieredBlockCache
    from cachefs.cache.base import BlockKey, checksum

    key = BlockKey.make(1, "dir/object", "etag-1", 0)
    with TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 1 << 20)]
    ) as cache:
        assert cache.block_file(key) is None
        data = os.urandom(3000)
        cache.put(key, data)
        block = cache.block_file(key)
        assert block.path == cache.block_path(key) and block.size == len(data)
        assert block.checksum == checksum(data)
        assert read_block_file(CachedBlock(block.path, block.size, block.checksum)) == data
        # A new admission of the same key writes a new file: the old answer no longer reads.
        cache.evict(key)
        cache.put(key, data[::-1])
        assert cache.block_file(key).path != block.path
        assert read_block_file(CachedBlock(block.path, block.size, block.checksum)) is None


def test_cluster_prefetch_goes_through_the_owner_and_caches_each_block_once(
    moto_s3, fault_proxy, tmp_path
):
    """A hint on one node of a two-node copy: blocks of its own shards are fetched from the
    store and cached there, the others are asked of their owner, which fetches and caches
    them — the miss path's routing. Afterwards neither node's reads reach the store."""
    from tests.cluster_process import Cluster, locality_settled, read_all

    objects = make_objects()
    bucket = moto_s3.make_bucket()
    for key, data in objects.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    # Every block exactly once: no peer answer may time out and be read again from the store.
    cluster = Cluster(str(tmp_path / "cluster"), 2, peer_timeout="60s").start()
    try:
        cluster.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        hinting = cluster.workers[0]
        fault_proxy.reset_counts()
        hinting.client.prefetch("ds", sorted(objects))
        blocks = sum(blocks_of(len(data)) for data in objects.values())

        def processed() -> bool:
            counters = hinting.status()["prefetch"]
            return (
                counters["queued_files"] == 0
                and counters["blocks_fetched"]
                + counters["blocks_failed"]
                + counters["blocks_cached"]
                >= blocks
            )

        wait_for(processed, "the hint to be processed")
        assert hinting.status()["prefetch"]["blocks_failed"] == 0
        assert fault_proxy.count("GET", path_contains="/ds/") == blocks
        report = locality_settled(cluster, "ds", sum(len(d) for d in objects.values()))
        assert all(row["cached_bytes"] > 0 for row in report["nodes"])  # at each owner
        for worker in cluster.workers:
            drop_page_cache()
            assert read_all(worker.mount, objects) == []
        assert fault_proxy.count("GET", path_contains="/ds/") == blocks
    finally:
        cluster.cleanup()
