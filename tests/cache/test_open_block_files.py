"""Kept block-file descriptors: reads reuse them, every way a block leaves the cache closes them
(so tmpfs frees the memory of removed blocks), the table stays bounded, and damage on disk is
still caught through a kept descriptor.

What is open is read from /proc/self/fd: a descriptor of an unlinked file shows as
"<path> (deleted)", which is exactly the memory that would never be freed."""

from __future__ import annotations

import os
import random
import threading

import pytest

import cachefs.cache.tier as tier_module
import cachefs.cache.tiered as tiered_module
from cachefs.cache.open_files import OpenBlockFiles
from cachefs.cache.tier import Tier, TierConfig, prepare_directory
from tests.cache.blockcache_helpers import BLOCK, block_data, block_files_bytes, key


def open_fds_under(directory) -> list[str]:
    """Targets of this process's descriptors of files under ``directory``."""
    prefix = os.path.realpath(directory) + "/"
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread)
            continue
        if target.startswith(prefix):
            targets.append(target)
    return targets


def deleted(targets: list[str]) -> list[str]:
    return [target for target in targets if target.endswith(" (deleted)")]


def write_file(path, data: bytes) -> int:
    """Write ``data`` to ``path`` and return a read descriptor of it."""
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


# --- the table on its own -----------------------------------------------------------------------


def test_a_kept_file_is_reused_and_the_least_recently_used_is_closed_beyond_the_limit(tmp_path):
    files = OpenBlockFiles(limit=2)
    for file_id in (1, 2, 3):
        assert files.acquire(file_id) is None
        files.release(files.add(file_id, write_file(tmp_path / str(file_id), bytes([file_id]))))
        if file_id == 2:
            files.release(files.acquire(1))  # 1 is now more recent than 2
    assert len(files) == 2
    assert files.acquire(2) is None  # pushed out, and closed
    assert sorted(open_fds_under(tmp_path)) == [str(tmp_path / "1"), str(tmp_path / "3")]
    kept = files.acquire(3)
    assert os.pread(kept.fd, 1, 0) == b"\x03"
    files.release(kept)
    files.close()
    assert open_fds_under(tmp_path) == []


def test_a_file_forgotten_while_a_read_holds_it_closes_when_that_read_is_done(tmp_path):
    files = OpenBlockFiles(limit=4)
    held = files.add(1, write_file(tmp_path / "1", b"block one"))
    os.unlink(tmp_path / "1")
    files.forget(1)

    assert files.acquire(1) is None
    # Still open for the read that holds it: closing it under the read would let the number
    # be reused by another open() and the read see another file's bytes.
    assert os.pread(held.fd, 9, 0) == b"block one"
    files.release(held)
    assert open_fds_under(tmp_path) == []


def test_a_block_removed_while_it_is_being_opened_is_not_kept(tmp_path, monkeypatch):
    """The removal unlinks the file and runs its forget() between this read's open() and its
    add(): keeping the descriptor then would hold the removed file's memory."""
    tier = Tier(TierConfig("ram", str(tmp_path), 1 << 20), 0, open_files_limit=4)
    prepare_directory(str(tmp_path))
    raw = key(1).raw
    tier.write_block(raw, 7, b"block")

    class RemovedRightAfterOpen:
        def __getattr__(self, name):
            return getattr(os, name)

        def open(self, path, flags):
            fd = os.open(path, flags)
            tier.remove_block(raw, 7)
            return fd

    monkeypatch.setattr(tier_module, "os", RemovedRightAfterOpen())
    with pytest.raises(FileNotFoundError):
        tier.open_block(raw, 7)
    assert open_fds_under(tmp_path) == []


def test_two_threads_opening_one_file_keep_one_descriptor(tmp_path):
    files = OpenBlockFiles(limit=4)
    first = files.add(1, write_file(tmp_path / "1", b"x"))
    second = files.add(1, os.open(tmp_path / "1", os.O_RDONLY))
    assert second is first and len(open_fds_under(tmp_path)) == 1
    files.release(first)
    files.release(second)
    files.close()
    assert open_fds_under(tmp_path) == []


# --- in the tiered cache ------------------------------------------------------------------------


def test_reads_keep_the_block_file_open_and_every_removal_closes_it(make_cache, tmp_path):
    cache = make_cache(ram=8 * BLOCK, ssd=8 * BLOCK)
    for i in range(4):
        cache.put(key(i, source_id=1 + i % 2), block_data(i))
    for i in range(4):
        assert cache.read(key(i, source_id=1 + i % 2), 5, 10) == block_data(i)[5:15]
    assert len(open_fds_under(tmp_path / "ram")) == 4
    assert cache.read(key(0, source_id=1)) == block_data(0)  # again, through the kept one
    assert len(open_fds_under(tmp_path / "ram")) == 4

    cache.evict(key(0, source_id=1))
    cache.evict_source(2)  # blocks 1 and 3
    assert open_fds_under(tmp_path / "ram") == [
        os.path.realpath(cache.block_path(key(2, source_id=1)))
    ]
    cache.free_blocks(1)
    assert open_fds_under(tmp_path / "ram") == []
    assert block_files_bytes(str(tmp_path / "ram")) == 0


def test_lru_eviction_closes_the_file_of_the_block_it_evicts(make_cache, tmp_path):
    cache = make_cache(ram=2 * BLOCK, admission="lru")
    for i in range(2):
        cache.put(key(i), block_data(i))
        assert cache.read(key(i)) == block_data(i)  # its file is kept open
    cache.put(key(2), block_data(2))  # evicts block 0, the least recently used

    assert not cache.contains(key(0))
    assert open_fds_under(tmp_path / "ram") == [os.path.realpath(cache.block_path(key(1)))]


def test_promotion_closes_the_file_it_moves_the_block_out_of(make_cache, tmp_path):
    cache = make_cache(ram=1 * BLOCK, ssd=4 * BLOCK, promote=True)
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))  # RAM is full: to the SSD
    assert cache.read(key(1), 0, 10) == block_data(1)[:10]  # RAM full: not promoted
    assert len(open_fds_under(tmp_path / "ssd")) == 1
    cache.evict(key(0))

    assert cache.read(key(1), 0, 10) == block_data(1)[:10]  # now promoted
    assert cache.locate(key(1)) == "ram"
    assert open_fds_under(tmp_path / "ssd") == []
    assert cache.read(key(1), 10, 10) == block_data(1)[10:20]


def test_the_open_files_stay_within_the_limit(make_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(tiered_module, "OPEN_BLOCK_FILES", 10)
    cache = make_cache(ram=40 * BLOCK, ssd=40 * BLOCK)
    for i in range(60):
        cache.put(key(i), block_data(i))
    for i in range(60):
        assert cache.read(key(i), 1, 2) == block_data(i)[1:3]
    assert len(open_fds_under(tmp_path / "ram")) == 5  # the limit, shared by the two tiers
    assert len(open_fds_under(tmp_path / "ssd")) == 5
    cache.close()
    assert open_fds_under(tmp_path) == []


def test_damage_behind_a_kept_descriptor_is_still_caught(make_cache, tmp_path):
    cache = make_cache()
    for i in range(3):
        cache.put(key(i), block_data(i))
        assert cache.read(key(i)) == block_data(i)  # verified, and its file kept open
    with open(cache.block_path(key(0)), "r+b") as block_file:  # a flipped byte
        block_file.seek(100)
        block_file.write(bytes([block_data(0)[100] ^ 0xFF]))
    os.truncate(cache.block_path(key(1)), BLOCK // 2)
    os.unlink(cache.block_path(key(2)))  # deleted behind the index's back

    assert cache.read(key(0)) is None
    assert cache.read(key(1), 0, 10) is None
    assert cache.read(key(2), 0, 10) is None  # the kept descriptor could still read it
    counters = cache.counters()
    assert (counters.corrupt, counters.missing) == (2, 1)
    assert open_fds_under(tmp_path / "ram") == []
    assert cache.usage()[0].used == 0


def test_read_from_one_tier_only_leaves_blocks_of_other_tiers_alone(make_cache):
    cache = make_cache(ram=1 * BLOCK, ssd=4 * BLOCK)
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))  # RAM is full: to the SSD

    assert cache.read(key(0), 3, 4, tier="ram") == block_data(0)[3:7]
    assert cache.read(key(1), tier="ram") is None
    assert cache.read(key(1), tier="nvme") is None  # no such tier: holds nothing
    assert cache.read(key(9), tier="ram") is None
    assert cache.locate(key(1)) == "ssd"  # not dropped, not counted as missing
    assert cache.read(key(1), tier="ssd") == block_data(1)
    assert cache.counters().missing == cache.counters().corrupt == 0


def test_concurrent_reads_and_removals_leave_no_file_of_a_removed_block_open(
    make_cache, tmp_path, monkeypatch
):
    """Reads on several threads race with evictions, removals and promotions of the same
    blocks, with a small descriptor table so that pushing out races too: the bytes are always
    right, and afterwards no descriptor of a removed file is left."""
    monkeypatch.setattr(tiered_module, "OPEN_BLOCK_FILES", 8)
    cache = make_cache(ram=6 * BLOCK, ssd=10 * BLOCK, admission="lru", promote=True)
    threads_count = 6
    start = threading.Barrier(threads_count)
    wrong: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []

    def worker(thread_no: int) -> None:
        rng = random.Random(thread_no)
        start.wait()
        try:
            for _ in range(300):
                i = rng.randrange(30)
                if rng.random() < 0.1:
                    cache.evict(key(i))
                    continue
                offset, length = rng.choice([(0, -1), (rng.randrange(BLOCK), rng.randrange(64))])
                got = cache.read(key(i), offset, length)
                if got is None:
                    cache.put(key(i), block_data(i))
                elif got != block_data(i)[offset : BLOCK if length < 0 else offset + length]:
                    wrong.append((i, offset, length))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors
    assert not wrong
    assert cache.counters().evicted > 0
    still_open = open_fds_under(tmp_path / "ram") + open_fds_under(tmp_path / "ssd")
    assert deleted(still_open) == []
    assert len(still_open) <= 8
    cache.close()
    assert open_fds_under(tmp_path) == []


@pytest.mark.parametrize("limit", [0, 1])
def test_tiny_tables_still_read_right(make_cache, tmp_path, monkeypatch, limit):
    monkeypatch.setattr(tiered_module, "OPEN_BLOCK_FILES", limit)
    cache = make_cache()
    for i in range(3):
        cache.put(key(i), block_data(i))
    for _ in range(2):
        for i in range(3):
            assert cache.read(key(i), 7, 9) == block_data(i)[7:16]
    assert len(open_fds_under(tmp_path / "ram")) == limit
