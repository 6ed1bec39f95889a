"""Kept block-file descriptors: a block read again soon keeps its file open, every way a block
leaves the cache closes it (so tmpfs frees the memory of removed blocks), the table stays
bounded, and damage on disk is still caught through a kept descriptor.

What is open is read from /proc/self/fd: a descriptor of an unlinked file shows as
"<path> (deleted)", which is exactly the memory that would never be freed."""

from __future__ import annotations

import os
import random
import threading

import pytest

import cachefs.cache.open_files as open_files_module
import cachefs.cache.opening as opening_module
from cachefs.cache.open_files import OpenBlockFiles
from tests.damage import flip_byte
from tests.unit.cache.blockcache_helpers import BLOCK, block_data, block_files_du, key


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


def table(directory, limit: int) -> OpenBlockFiles:
    """A table over files named by their file id in ``directory`` (1, 2, ...)."""
    return OpenBlockFiles(limit, lambda raw, file_id: str(directory / str(file_id)))


def read_file(files: OpenBlockFiles, file_id: int) -> bytes:
    """One read of a whole file through the table."""
    fd, stat, kept = files.open(b"", file_id)
    try:
        return os.pread(fd, stat.st_size, 0)
    finally:
        files.release(fd, kept)


class OsWithOpenHook:
    """``os`` for the module under test, running ``hook(path)`` right after each open()."""

    def __init__(self, hook):
        self.hook = hook

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags):
        fd = os.open(path, flags)
        self.hook(path)
        return fd


# --- the table on its own -----------------------------------------------------------------------


def test_a_file_read_again_soon_is_kept_and_the_least_recent_leaves_beyond_the_limit(tmp_path):
    files = table(tmp_path, limit=2)
    for file_id in range(1, 9):
        (tmp_path / str(file_id)).write_bytes(bytes([file_id]))
    for file_id in (1, 2, 3, 4, 5, 6, 7, 1):  # 1 again, but 6 other files later
        assert read_file(files, file_id) == bytes([file_id])
    assert len(files) == 0 and open_fds_under(tmp_path) == []  # a scan keeps nothing
    for file_id in (1, 2, 1, 2, 1, 3, 3):  # 1 is now more recent than 2, which 3 pushes out
        assert read_file(files, file_id) == bytes([file_id])
    assert len(files) == 2
    assert sorted(open_fds_under(tmp_path)) == [str(tmp_path / "1"), str(tmp_path / "3")]
    files.close()
    assert open_fds_under(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        files.open(b"", 9)  # no such file


def test_a_file_forgotten_while_a_read_holds_it_closes_when_that_read_is_done(tmp_path):
    files = table(tmp_path, limit=4)
    (tmp_path / "1").write_bytes(b"block one")
    assert read_file(files, 1) == b"block one"  # the first read: not kept
    fd, _stat, held = files.open(b"", 1)
    assert held is not None
    os.unlink(tmp_path / "1")
    files.forget(1)

    # Still open for the read that holds it: closing it under the read would let the number
    # be reused by another open() and the read see another file's bytes.
    assert os.pread(fd, 9, 0) == b"block one"
    files.release(fd, held)
    assert open_fds_under(tmp_path) == []


@pytest.mark.parametrize("earlier_reads", [0, 1])
def test_a_file_removed_while_it_is_being_opened_is_not_kept(tmp_path, monkeypatch, earlier_reads):
    """The removal unlinks the file and runs its forget() between this read's open() and the
    moment the descriptor enters the table: keeping it would hold the removed file's memory."""
    files = table(tmp_path, limit=4)
    (tmp_path / "1").write_bytes(b"x")
    for _ in range(earlier_reads):  # with one, this read is the second: it would keep it
        assert read_file(files, 1) == b"x"

    def removal(path):
        os.unlink(path)
        files.forget(1)

    monkeypatch.setattr(open_files_module, "os", OsWithOpenHook(removal))
    with pytest.raises(FileNotFoundError):
        files.open(b"", 1)
    assert len(files) == 0
    assert open_fds_under(tmp_path) == []


def test_two_threads_opening_one_file_keep_one_descriptor(tmp_path, monkeypatch):
    files = table(tmp_path, limit=4)
    (tmp_path / "1").write_bytes(b"x")
    assert read_file(files, 1) == b"x"
    other_reads = []
    opens = []

    def another_thread_opens_it_too(path):
        opens.append(path)
        if len(opens) == 1:  # between this open() and the table: the other read's whole open
            other_reads.append(files.open(b"", 1))

    monkeypatch.setattr(open_files_module, "os", OsWithOpenHook(another_thread_opens_it_too))
    fd, _stat, kept = files.open(b"", 1)
    other_fd, _other_stat, other_kept = other_reads[0]
    assert kept is other_kept and fd == other_fd and kept.users == 2
    assert len(open_fds_under(tmp_path)) == 1
    files.release(fd, kept)
    files.release(other_fd, other_kept)
    assert len(open_fds_under(tmp_path)) == 1  # still kept for later reads
    files.close()
    assert open_fds_under(tmp_path) == []


# --- in the tiered cache ------------------------------------------------------------------------


def test_reads_keep_the_block_file_open_and_every_removal_closes_it(make_cache, tmp_path):
    cache = make_cache(ram=8 * BLOCK, ssd=8 * BLOCK)
    for i in range(4):
        cache.put(key(i, source_id=1 + i % 2), block_data(i))
    for offset in (5, 50):  # two reads of each block: the second keeps its file open
        for i in range(4):
            got = cache.read(key(i, source_id=1 + i % 2), offset, 10)
            assert got == block_data(i)[offset : offset + 10]
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
    assert block_files_du(str(tmp_path / "ram")) == 0


def test_lru_eviction_closes_the_file_of_the_block_it_evicts(make_cache, tmp_path):
    cache = make_cache(ram=2 * BLOCK, admission="lru")
    for i in range(2):
        cache.put(key(i), block_data(i))
        for _ in range(2):
            assert cache.read(key(i)) == block_data(i)  # its file is kept open
    assert len(open_fds_under(tmp_path / "ram")) == 2
    cache.put(key(2), block_data(2))  # evicts block 0, the least recently used

    assert not cache.contains(key(0))
    assert open_fds_under(tmp_path / "ram") == [os.path.realpath(cache.block_path(key(1)))]


def test_promotion_closes_the_file_it_moves_the_block_out_of(make_cache, tmp_path):
    cache = make_cache(ram=1 * BLOCK, ssd=4 * BLOCK, promote=True)
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))  # RAM is full: to the SSD
    for _ in range(2):
        assert cache.read(key(1), 0, 10) == block_data(1)[:10]  # RAM full: not promoted
    assert len(open_fds_under(tmp_path / "ssd")) == 1
    cache.evict(key(0))

    assert cache.read(key(1), 0, 10) == block_data(1)[:10]  # now promoted
    assert cache.locate(key(1)) == "ram"
    assert open_fds_under(tmp_path / "ssd") == []
    assert cache.read(key(1), 10, 10) == block_data(1)[10:20]


def test_the_open_files_stay_within_the_limit(make_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(opening_module, "OPEN_BLOCK_FILES", 10)
    cache = make_cache(ram=40 * BLOCK, ssd=40 * BLOCK)
    for i in range(60):
        cache.put(key(i), block_data(i))
    for i in range(60):
        for offset in (1, 2):  # read twice in a row: kept
            assert cache.read(key(i), offset, 2) == block_data(i)[offset : offset + 2]
    assert len(open_fds_under(tmp_path / "ram")) == 5  # the limit, shared by the two tiers
    assert len(open_fds_under(tmp_path / "ssd")) == 5
    cache.close()
    assert open_fds_under(tmp_path) == []


def test_damage_behind_a_kept_descriptor_is_still_caught(make_cache, tmp_path):
    cache = make_cache()
    for i in range(3):
        cache.put(key(i), block_data(i))
        for _ in range(2):
            assert cache.read(key(i)) == block_data(i)  # verified, and its file kept open
    assert len(open_fds_under(tmp_path / "ram")) == 3
    flip_byte(cache.block_path(key(0)), 100)
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
    monkeypatch.setattr(opening_module, "OPEN_BLOCK_FILES", 8)
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
    monkeypatch.setattr(opening_module, "OPEN_BLOCK_FILES", limit)
    cache = make_cache()
    for i in range(3):
        cache.put(key(i), block_data(i))
    for i in range(3):
        for _ in range(2):
            assert cache.read(key(i), 7, 9) == block_data(i)[7:16]
    assert len(open_fds_under(tmp_path / "ram")) == limit
