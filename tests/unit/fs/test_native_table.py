"""The native READ table of the patched pyfuse3 (cachefs_fast_read.c), without a mount: what it
accepts, what its forgets remove, its size bound; and NativeReads filling it from a real
TieredBlockCache and emptying it when the cache removes a block file. The READs it answers are
tested through real mounts in test_native_reads.py."""

from __future__ import annotations

import os
import socket

import pytest
import xxhash

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import CHUNK_SIZE, BlockKey
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from cachefs.fs.native_reads import NativeReads
from cachefs.metrics import WorkerMetrics

pytestmark = pytest.mark.skipif(
    not FAST_READ_SUPPORTED, reason="stock pyfuse3: run scripts/setup.sh to build the patched one"
)

SUMS_ONE_CHUNK = b"\0" * 8


def test_registrations_are_checked_and_forgets_remove_exactly_theirs(table):
    refused = table.stats()["refused"]  # counters are the process's, since its start
    # A file of 3 blocks of 100 bytes (the last one 50): block 2 must say 50 bytes.
    assert table.register(10, 0, 100, 250, 1, b"/x/a", 100, SUMS_ONE_CHUNK)
    assert table.register(10, 2, 100, 250, 2, b"/x/b", 50, SUMS_ONE_CHUNK)
    assert not table.register(10, 2, 100, 250, 3, b"/x/c", 100, SUMS_ONE_CHUNK)  # wrong length
    assert not table.register(10, 3, 100, 250, 3, b"/x/c", 0, b"")  # past the end
    assert not table.register(11, 0, 100, 80, 4, b"/x/d", 80, b"")  # no checksum for a chunk
    assert table.register(11, 0, 100, 80, 5, b"/x/e", 80, SUMS_ONE_CHUNK)
    assert table.register(12, 0, 100, 80, 5, b"/x/e", 80, SUMS_ONE_CHUNK)  # same file, 2 inodes
    stats = table.stats()
    assert (stats["blocks"], stats["files"], stats["refused"] - refused) == (4, 3, 3)

    table.forget_file(5)  # both inodes' blocks of that cache file
    assert (table.stats()["blocks"], table.stats()["files"]) == (2, 1)
    table.forget_inodes(10, 10)
    assert (table.stats()["blocks"], table.stats()["files"]) == (0, 0)


def test_a_new_version_of_a_file_replaces_every_block_of_the_old(table):
    assert table.register(20, 0, 100, 150, 1, b"/x/a", 100, SUMS_ONE_CHUNK)
    assert table.register(20, 1, 100, 150, 2, b"/x/b", 50, SUMS_ONE_CHUNK)
    assert table.register(20, 0, 100, 120, 3, b"/x/c", 100, SUMS_ONE_CHUNK)  # other size
    assert table.stats()["blocks"] == 1
    table.forget_file(2)  # the old version's block is gone already: nothing else goes
    assert table.stats()["blocks"] == 1


def test_the_table_keeps_at_most_its_limit_dropping_the_oldest(table):
    table.configure(CHUNK_SIZE, 3, 3)
    for ino in range(1, 6):
        assert table.register(ino, 0, 100, 10, ino, b"/x/%d" % ino, 10, SUMS_ONE_CHUNK)
    stats = table.stats()
    assert (stats["blocks"], stats["limit_drops"]) == (3, 2)
    table.forget_inodes(1, 2)  # already dropped: nothing happens
    table.forget_inodes(3, 3)
    assert table.stats()["blocks"] == 2
    table.configure(CHUNK_SIZE, 0, 0)  # off: nothing is kept
    assert table.stats()["blocks"] == 0
    assert not table.register(9, 0, 100, 10, 9, b"/x/9", 10, SUMS_ONE_CHUNK)


def test_native_reads_registers_ram_tier_blocks_and_forgets_them_on_removal(tmp_path, table):
    ram = TierConfig("ram", str(tmp_path / "ram"), 2 * 4096, 0)  # two blocks: the rest to SSD
    ssd = TierConfig("ssd", str(tmp_path / "ssd"), 1 << 20, 0)
    with TieredBlockCache(str(tmp_path / "index"), [ram, ssd]) as cache:
        reader = BlockReader(cache, WorkerMetrics())
        native = NativeReads(table, cache, reader, max_blocks=100)
        source = DataSource("ds", store=None, source_id=7, block_size=4096)
        version = FileVersion("a.bin", "etag-1", 3 * 4096 + 10)
        keys = [BlockKey.make(7, "a.bin", "etag-1", index) for index in range(4)]
        data = [bytes([i]) * min(4096, version.size - i * 4096) for i in range(4)]
        for index in (0, 1, 3):  # block 2 is not cached
            cache.put(keys[index], data[index])
        assert [cache.locate(keys[i]) for i in (0, 1, 3)] == ["ram", "ram", "ssd"]
        # The native path reads only the RAM tier.
        assert native.register_blocks(99, source, version, 0, 10) == 2
        found = cache.chunked_block_file(keys[0], tier="ram")
        assert found.size == 4096 and found.chunk_checksums == xxhash.xxh3_64_digest(data[0])
        now = os.stat(found.path)  # the state the put left the file in goes to the table with it
        assert found.written_state == (now.st_ino, now.st_ctime_ns)
        assert cache.chunked_block_file(keys[3], tier="ram") is None
        assert cache.chunked_block_file(keys[3], tier="ssd") is not None

        cache.evict(keys[1])  # every removal goes through the cache's hook
        assert table.stats()["blocks"] == 1
        cache.evict_source(7)
        assert table.stats()["blocks"] == 0
        native.close()


def test_block_arrays_count_against_the_bound_so_sparse_large_files_cannot_grow_it(table):
    """A file's block array has a slot per block of the file: at most 4 per registrable block
    in all, so registering one block each of many large files cannot take unbounded memory."""
    table.configure(CHUNK_SIZE, 2, 2)  # at most 8 array slots
    drops = table.stats()["limit_drops"]  # counters are the process's, since its start
    assert not table.register(1, 0, 100, 900, 1, b"/x/a", 100, SUMS_ONE_CHUNK)  # 9 blocks
    assert table.register(2, 0, 100, 500, 2, b"/x/b", 100, SUMS_ONE_CHUNK)  # 5 slots
    assert table.register(3, 4, 100, 500, 3, b"/x/c", 100, SUMS_ONE_CHUNK)  # 5 more: 2 goes
    stats = table.stats()
    assert (stats["blocks"], stats["files"], stats["limit_drops"] - drops) == (1, 1, 1)


def test_listings_are_checked_bounded_and_forgotten_with_their_inodes(table, monkeypatch):
    """A packed listing (cfr_register_listing's records) is kept whole or refused whole, at most
    a quarter of the table's bytes for one directory; forget_inodes drops the listings of
    directories in its range; the packer gives up past MAX_LISTING_ENTRIES."""
    from cachefs.fs import native_reads
    from cachefs.fs.native_reads import LISTING_RECORD, ListingPacker

    table.configure_listings(1 << 20, 1.0, 1.0)
    try:
        packer = ListingPacker()
        assert packer.add(b"a.bin", 101, 1, 10, 5, 0o100444, 1, 0, 0)
        assert packer.add(b"dir", 102, 2, 0, 5, 0o40555, 2, 0, 0)
        packed, count = packer.packed
        assert count == 2
        assert packed[: LISTING_RECORD.size] == LISTING_RECORD.pack(
            101, 1, 10, 5, 0o100444, 1, 0, 0, 5
        )
        assert table.register_listing(7, packed, count)
        assert table.stats()["listings"] == 1 and table.stats()["listing_bytes"] > 0
        assert not table.register_listing(8, packed[:-1], count)  # a name cut short
        assert not table.register_listing(8, packed, count + 1)  # a record missing
        too_big = ListingPacker()
        for i in range(3000):  # ~220 KB of records: more than a quarter of 1 MiB
            too_big.add(f"f{i:060d}".encode(), 1000 + i, i + 1, 1, 1, 0o100444, 1, 0, 0)
        assert not table.register_listing(9, *too_big.packed)
        assert table.stats()["listings"] == 1

        table.forget_inodes(8, 100)  # not directory 7
        assert table.stats()["listings"] == 1
        table.forget_inodes(7, 7)
        assert table.stats()["listings"] == table.stats()["listing_bytes"] == 0

        monkeypatch.setattr(native_reads, "MAX_LISTING_ENTRIES", 2)
        bounded = ListingPacker()
        assert bounded.add(b"x", 1, 1, 0, 0, 0o100444, 1, 0, 0)
        assert bounded.add(b"y", 2, 2, 0, 0, 0o100444, 1, 0, 0)
        assert not bounded.add(b"z", 3, 3, 0, 0, 0o100444, 1, 0, 0)
        assert bounded.packed is None
    finally:
        table.configure_listings(0, 0.0, 0.0)  # the table is the process's: leave it off


def test_the_binding_holds_a_connection_to_every_peer_of_a_thousand_node_cluster(table):
    """READs of other workers' files are sent from C, on one connection per owner; an owner
    with no free slot is read in Python (it held 64 once). Every slot is handed out, each
    takes a route, the next open is refused, and a closed slot is handed out again. (The slots
    share one socket here: opening and routing does no I/O on it.)"""
    import pyfuse3

    ours, theirs = socket.socketpair()
    slots: list[int] = []
    try:
        for _ in range(pyfuse3.fast_peer_slots()):
            slots.append(table.peer_open(ours.fileno(), 1 << 20))
        assert len(slots) >= 1024 and sorted(slots) == list(range(len(slots)))
        assert table.peer_open(ours.fileno(), 1 << 20) == -1  # all taken
        frame = bytes(64)  # routing keeps the frame; only a send would parse it
        assert table.peer_route(7, slots[-1], frame, 4096)
        assert not table.peer_route(8, slots[-1], frame, 2 << 20)  # past its max_length
        assert table.stats()["peer_routes"] == 1
        assert table.peer_close(slots[-1], False) == []  # nothing was pending
        assert table.peer_open(ours.fileno(), 1 << 20) == slots[-1]
        assert not table.peer_route(7, len(slots), frame, 4096)  # no such slot
    finally:
        for slot in slots:
            table.peer_close(slot, False)
        table.forget_inodes(7, 7)
        ours.close()
        theirs.close()
