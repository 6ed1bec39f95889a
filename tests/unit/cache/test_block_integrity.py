"""Every byte a TieredBlockCache serves is verified, and its tiers count what the filesystem
allocates.

Real parts: LMDB, a RAM tier on real tmpfs (/dev/shm) and an SSD tier on the disk filesystem of
tmp_path. Blocks are damaged as a faulty disk or a stray writer would: changed in place on disk
after they were admitted and read (the same inode, so a descriptor the cache keeps open sees
the change).
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import uuid

import lmdb
import pytest

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import CHUNK_SIZE, block_checksums, checksum, chunk_checksums
from cachefs.cache.index import Entry
from cachefs.cache.tier import MARKER_PREFIX, allocation_unit
from tests.damage import flip_byte
from tests.unit.cache.blockcache_helpers import block_files_du, key

PAGE = os.sysconf("SC_PAGE_SIZE")
# Four chunks, the last one short: reads can touch one chunk, several, or the short one.
SIZE = 3 * CHUNK_SIZE + 1000


@pytest.fixture
def shm_dir():
    """A RAM tier directory on real tmpfs, removed afterwards."""
    path = f"/dev/shm/cachefs-test-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def open_cache(tmp_path, shm_dir):
    """``open_cache(tier, ram=..., ssd=..., **options)``: a cache whose RAM tier is on tmpfs and
    whose SSD tier is under tmp_path; ``tier="ssd"`` gives the RAM tier no room, so blocks go to
    the SSD tier. Every cache still open at the end is closed."""
    opened: list[TieredBlockCache] = []

    def make(
        tier: str = "ram", *, ram: int = 64 << 20, ssd: int = 64 << 20, **options
    ) -> TieredBlockCache:
        tiers = [
            TierConfig("ram", shm_dir, ram if tier == "ram" else 0),
            TierConfig("ssd", str(tmp_path / "ssd"), ssd),
        ]
        cache = TieredBlockCache(str(tmp_path / "index"), tiers, **options)
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        cache.close()


def data_of(index: int, size: int = SIZE) -> bytes:
    return random.Random(index).randbytes(size)


def du(path: str) -> int:
    """What ``du`` says the directory takes, in bytes."""
    out = subprocess.run(["du", "-s", "-B1", path], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[0])


# --- a block changed on disk after its first read is never served -------------------------------


@pytest.mark.parametrize("read", ["partial", "whole"])
@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_a_block_changed_in_place_after_its_first_reads_is_never_served(open_cache, tier, read):
    cache = open_cache(tier)
    data = data_of(1)
    assert cache.put(key(1), data) == tier
    path = cache.block_path(key(1))
    for _ in range(2):  # read and verified; the second read keeps its file open
        assert cache.read(key(1), CHUNK_SIZE + 10, 100) == data[CHUNK_SIZE + 10 : CHUNK_SIZE + 110]
        assert cache.read(key(1)) == data

    flip_byte(path, CHUNK_SIZE + 50)  # in chunk 1, which both reads below touch

    if read == "partial":
        assert cache.read(key(1), CHUNK_SIZE + 10, 100) is None
    else:
        assert cache.read(key(1)) is None
    assert cache.counters().corrupt == 1
    assert not cache.contains(key(1))
    assert not os.path.exists(path)
    assert cache.read(key(1), 0, 10) is None  # dropped: the caller fetches it again
    assert sum(usage.used for usage in cache.usage()) == 0
    assert cache.put(key(1), data) == tier
    assert cache.read(key(1), CHUNK_SIZE + 10, 100) == data[CHUNK_SIZE + 10 : CHUNK_SIZE + 110]
    assert cache.read(key(1)) == data
    assert cache.counters().corrupt == 1


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_a_read_checks_exactly_the_chunks_it_touches(open_cache, tier):
    """Damage in chunk 2 is not read by a read of chunk 0 (whose bytes are right and are
    served), and is caught by every read that touches chunk 2 — even one byte of it."""
    cache = open_cache(tier)
    data = data_of(2)
    cache.put(key(2), data)
    assert cache.read(key(2)) == data
    flip_byte(cache.block_path(key(2)), 2 * CHUNK_SIZE + 5)

    assert cache.read(key(2), 0, CHUNK_SIZE) == data[:CHUNK_SIZE]
    assert cache.read(key(2), CHUNK_SIZE, CHUNK_SIZE) == data[CHUNK_SIZE : 2 * CHUNK_SIZE]
    assert cache.counters().corrupt == 0
    assert cache.read(key(2), 2 * CHUNK_SIZE - 1, 2) is None  # one byte of chunk 1, one of 2
    assert cache.counters().corrupt == 1
    assert not cache.contains(key(2))


def test_a_change_in_the_short_last_chunk_is_caught(open_cache):
    cache = open_cache()
    data = data_of(3)
    cache.put(key(3), data)
    assert cache.read(key(3), SIZE - 10, -1) == data[-10:]
    flip_byte(cache.block_path(key(3)), SIZE - 1)
    assert cache.read(key(3), SIZE - 1, 1) is None
    assert cache.counters().corrupt == 1


def test_any_range_returns_exactly_its_bytes(open_cache):
    """The chunk span arithmetic: ranges at and across chunk boundaries, in the short last
    chunk, past the end and empty."""
    cache = open_cache()
    data = data_of(4)
    cache.put(key(4), data)
    rng = random.Random(4)
    ranges = [
        (0, CHUNK_SIZE),
        (CHUNK_SIZE, CHUNK_SIZE),
        (CHUNK_SIZE - 1, 2),
        (CHUNK_SIZE, -1),
        (3 * CHUNK_SIZE, -1),
        (SIZE - 1, 10),
        (SIZE, 10),
        (SIZE + 5000, 10),
        (5, 0),
        (0, SIZE + 1),
    ]
    ranges += [(rng.randrange(SIZE + 100), rng.randrange(2 * CHUNK_SIZE)) for _ in range(200)]
    for offset, length in ranges:
        expected = data[offset:] if length < 0 else data[offset : offset + length]
        assert cache.read(key(4), offset, length) == expected, (offset, length)
    assert cache.counters().corrupt == 0


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_read_with_checksums_gives_the_checksums_recorded_at_admission(open_cache, tier):
    cache = open_cache(tier)
    data = data_of(5)
    cache.put(key(5), data)
    block = cache.read_with_checksums(key(5))
    assert block.data == data
    assert block.chunk_checksums == chunk_checksums(data)
    assert len(block.chunk_checksums) == 4 * 8
    flip_byte(cache.block_path(key(5)), 7)
    assert cache.read_with_checksums(key(5)) is None
    assert cache.counters().corrupt == 1


def test_a_promoted_block_keeps_its_checksums(open_cache, shm_dir):
    """Promotion copies the block into RAM: its checksums come along, and are checked there."""
    cache = open_cache("ram", ram=2 * SIZE, promote=True)
    for i in range(3):
        cache.put(key(i), data_of(i))  # the third goes to the SSD tier
    assert cache.locate(key(2)) == "ssd"
    cache.evict(key(0))
    assert cache.read(key(2), 10, 10) == data_of(2)[10:20]  # promoted
    assert cache.locate(key(2)) == "ram"
    flip_byte(cache.block_path(key(2)), 3 * CHUNK_SIZE + 1)
    assert cache.read(key(2), 3 * CHUNK_SIZE, 10) is None
    assert cache.counters().corrupt == 1


# --- tiers count what the filesystem allocates --------------------------------------------------


def test_the_ram_tier_unit_is_the_page_size(shm_dir):
    os.makedirs(shm_dir)
    assert allocation_unit(shm_dir) == PAGE


@pytest.mark.parametrize("admission", ["avoid-eviction", "lru"])
def test_du_of_the_ram_tier_never_exceeds_its_capacity(open_cache, shm_dir, admission):
    """Blocks of sizes that are no multiple of a page (a dataset of small files): each takes
    whole pages of tmpfs, which the tier counts, so ``du`` stays within the capacity."""
    capacity = 40 * PAGE
    cache = open_cache("ram", ram=capacity, ssd=4 * PAGE, admission=admission)
    rng = random.Random(7)
    for i in range(120):
        cache.put(key(i), data_of(i, rng.randint(1, 3 * PAGE)))
        assert du(shm_dir) <= capacity
    ram = next(usage for usage in cache.usage() if usage.name == "ram")
    assert du(shm_dir) == ram.used == block_files_du(shm_dir)
    assert ram.used > capacity - 3 * PAGE  # full, as far as whole blocks go
    assert cache.cached_bytes(1) < ram.used  # a dataset's bytes are counted as they are
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used <= usage.capacity


# --- an index from before chunk checksums -------------------------------------------------------

_LEGACY_ENTRY = struct.Struct(">BBQQQQ")
_LEGACY_TOTALS = struct.Struct(">QQQ")


def make_format_1(index_dir: str, tier_dirs: list[str]) -> None:
    """Turn a closed cache into what the version before chunk checksums left on disk: entries
    without footprint and chunk checksums, tier totals of sizes, index format "1", and tier
    markers holding their instance id as content."""
    env = lmdb.open(index_dir, max_dbs=3, subdir=True)
    blocks, meta = env.open_db(b"blocks"), env.open_db(b"meta")
    totals: dict[int, list[int]] = {}
    with env.begin(write=True) as txn:
        for raw, value in list(txn.cursor(db=blocks)):
            entry = Entry.unpack(value)
            old = (entry.tier_id, int(entry.reserved), entry.size, entry.checksum)
            txn.put(raw, _LEGACY_ENTRY.pack(*old, entry.stamp, entry.file_id), db=blocks)
            tier = totals.setdefault(entry.tier_id, [0, 0, 0])
            tier[0] += entry.size
            tier[1] += entry.size if entry.reserved else 0
            tier[2] += 1
        for tier_id, values in totals.items():
            txn.put(b"tier-totals/" + bytes((tier_id,)), _LEGACY_TOTALS.pack(*values), db=meta)
        txn.put(b"version", b"1", db=meta)
    env.close()
    for tier_dir in tier_dirs:
        (marker,) = [name for name in os.listdir(tier_dir) if name.startswith(MARKER_PREFIX)]
        os.unlink(os.path.join(tier_dir, marker))
        with open(os.path.join(tier_dir, ".cachefs-tier"), "w") as old_marker:
            old_marker.write(marker.removeprefix(MARKER_PREFIX) + "\n")


def test_an_index_of_format_1_opens_warm_and_is_verified(open_cache, tmp_path, shm_dir):
    """Upgraded at open: footprints counted (blocks evicted if they no longer fit), every
    block still there and served right. A block's first read checks it whole against its old
    checksum and records its chunk checksums; from then on reads check chunks."""
    cache = open_cache("ram", ram=256 * PAGE)
    sizes = {i: PAGE // 2 + i for i in range(6)}  # half a page each: 6 take 6 whole pages
    for i in range(6):
        cache.put(key(i), data_of(i, sizes[i]))
    big = data_of(10)
    cache.put(key(10), big)
    cache.read(key(0), 0, 10)  # blocks 1 and 2 become the least recently used
    cache.close()
    make_format_1(str(tmp_path / "index"), [shm_dir, str(tmp_path / "ssd")])

    # Their sizes fit; their footprints (a page per small block) are 2 pages too many.
    big_footprint = -(-len(big) // PAGE) * PAGE
    capacity = 4 * PAGE + big_footprint
    cache = open_cache("ram", ram=capacity)

    assert [cache.contains(key(i)) for i in range(6)] == [True, False, False, True, True, True]
    assert cache.counters().evicted == 2
    ram = next(usage for usage in cache.usage() if usage.name == "ram")
    assert ram.used == capacity == du(shm_dir)
    assert os.listdir(shm_dir).count(".cachefs-tier") == 0  # the old marker was replaced
    for i in (0, 3, 4, 5):
        assert cache.read(key(i), 1, 5) == data_of(i, sizes[i])[1:6]
    assert cache.counters().corrupt == 0

    # Not read yet: a partial read checks the whole block, so damage anywhere is caught.
    flip_byte(cache.block_path(key(10)), 3 * CHUNK_SIZE + 1)
    assert cache.read(key(10), 0, 10) is None
    assert cache.counters().corrupt == 1

    # Read once: its chunk checksums are stored; then a read checks only its own chunks.
    cache.put(key(10), big)  # a new admission, with chunk checksums of its own
    cache.close()
    make_format_1(str(tmp_path / "index"), [shm_dir, str(tmp_path / "ssd")])
    cache = open_cache("ram", ram=capacity)
    assert cache.read(key(10), 0, 10) == big[:10]  # verified whole, chunk checksums queued
    cache.flush()
    flip_byte(cache.block_path(key(10)), 3 * CHUNK_SIZE + 1)
    assert cache.read(key(10), 0, 10) == big[:10]
    assert cache.read(key(10), 3 * CHUNK_SIZE, 10) is None
    assert cache.counters().corrupt == 1


@pytest.mark.parametrize("size", [0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE])
def test_block_checksums_hash_a_one_chunk_block_once_and_agree_with_both(size):
    """block_checksums (the fetchers' one pass for a block of one chunk) is exactly the pair of
    checksum and chunk_checksums, for bytes and for a bytearray."""
    data = random.Random(size).randbytes(size)
    for block in (data, bytearray(data)):
        assert block_checksums(block) == (checksum(data), chunk_checksums(data))
