"""TieredBlockCache across restarts, crashes and damaged files: it comes back warm, never serves
wrong bytes, and its accounting matches what is on disk.

Crashes are real: a child process fills a cache and kills itself with SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.damage import flip_byte
from tests.unit.cache.blockcache_helpers import BLOCK, block_data, block_files_du, key

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_restart_comes_back_warm(make_cache):
    cache = make_cache(ram=4 * BLOCK, ram_reserve=BLOCK, ssd=4 * BLOCK)
    for i in range(6):
        cache.put(key(i, source_id=i % 2), block_data(i, BLOCK - i))
    usage_before = cache.usage()
    cache.close()

    cache = make_cache(ram=4 * BLOCK, ram_reserve=BLOCK, ssd=4 * BLOCK)

    assert cache.usage() == usage_before
    assert [usage.blocks for usage in usage_before] == [4, 2]
    assert cache.cached_bytes(0) == sum(BLOCK - i for i in (0, 2, 4))
    assert cache.cached_bytes(1) == sum(BLOCK - i for i in (1, 3, 5))
    for i in range(6):
        assert cache.read(key(i, source_id=i % 2)) == block_data(i, BLOCK - i)
    assert cache.counters().corrupt == cache.counters().missing == 0


def test_lru_order_survives_a_restart(make_cache):
    cache = make_cache(ram=3 * BLOCK, admission="lru")
    for i in range(3):
        cache.put(key(i), block_data(i))
    cache.read(key(0))  # the stamp is only in memory until close() writes it
    cache.close()

    cache = make_cache(ram=3 * BLOCK, admission="lru")
    cache.put(key(3), block_data(3))
    assert [i for i in range(4) if cache.contains(key(i))] == [0, 2, 3]


def test_wiped_ram_directory_drops_its_entries_and_keeps_the_ssd(make_cache, tmp_path):
    cache = make_cache(ram=2 * BLOCK, ssd=4 * BLOCK)
    for i in range(4):
        cache.put(key(i), block_data(i))
    cache.close()
    shutil.rmtree(tmp_path / "ram")  # what a reboot does to tmpfs

    cache = make_cache(ram=2 * BLOCK, ssd=4 * BLOCK)

    assert [cache.locate(key(i)) for i in range(4)] == [None, None, "ssd", "ssd"]
    assert [(usage.name, usage.used, usage.blocks) for usage in cache.usage()] == [
        ("ram", 0, 0),
        ("ssd", 2 * BLOCK, 2),
    ]
    assert cache.cached_bytes(1) == 2 * BLOCK
    assert cache.counters().missing == 0  # dropped at open, not discovered by reads
    assert cache.put(key(0), block_data(0)) == "ram"
    assert cache.read(key(0)) == block_data(0)


def test_a_tier_left_out_of_the_configuration_is_forgotten(make_cache, tmp_path):
    cache = make_cache(ram=2 * BLOCK, ssd=4 * BLOCK)
    for i in range(4):
        cache.put(key(i), block_data(i))
    cache.close()

    cache = make_cache(ram=2 * BLOCK)  # no SSD tier any more

    assert [cache.locate(key(i)) for i in range(4)] == ["ram", "ram", None, None]
    assert cache.cached_bytes(1) == 2 * BLOCK


def test_a_flipped_byte_is_caught_by_a_whole_block_read(make_cache):
    # Partial reads, on every tier, are in test_block_integrity.py.
    cache = make_cache()
    cache.put(key(1), block_data(1))
    flip_byte(cache.block_path(key(1)), 700)

    assert cache.read(key(1)) is None

    assert cache.counters().corrupt == 1
    assert not cache.contains(key(1))
    assert cache.usage()[0].used == 0
    assert cache.put(key(1), block_data(1)) == "ram"
    assert cache.read(key(1)) == block_data(1)


def test_a_flipped_byte_after_a_restart_is_caught_by_a_partial_read(make_cache):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    assert cache.read(key(1)) == block_data(1)  # verified in this process
    path = cache.block_path(key(1))
    cache.close()
    flip_byte(path, 5)

    cache = make_cache()
    assert cache.read(key(1), 500, 10) is None
    assert cache.counters().corrupt == 1


def test_a_verified_block_is_checked_again_on_every_whole_read(make_cache):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    assert cache.read(key(1)) == block_data(1)
    flip_byte(cache.block_path(key(1)), 1000)

    assert cache.read(key(1)) is None
    assert cache.counters().corrupt == 1
    assert not cache.contains(key(1))
    assert cache.usage()[0].used == 0


def test_a_truncated_block_is_caught_even_by_a_partial_read(make_cache):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    assert cache.read(key(1)) == block_data(1)
    os.truncate(cache.block_path(key(1)), BLOCK // 2)

    assert cache.read(key(1), 0, 10) is None
    assert cache.counters().corrupt == 1
    assert cache.usage()[0].used == 0
    assert cache.put(key(1), block_data(1)) == "ram"
    assert cache.read(key(1), 0, 10) == block_data(1)[:10]


def test_a_deleted_block_file_is_counted_missing(make_cache, tmp_path):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    cache.put(key(2), block_data(2))
    os.unlink(cache.block_path(key(1)))

    assert cache.read(key(1)) is None
    counters = cache.counters()
    assert (counters.missing, counters.corrupt) == (1, 0)
    assert not cache.contains(key(1))
    assert cache.usage()[0].used == BLOCK == block_files_du(str(tmp_path / "ram"))
    assert cache.put(key(1), block_data(1)) == "ram"
    assert cache.read(key(1)) == block_data(1)


_CRASHING_CHILD = """
import os, signal, sys
from tests.unit.cache.blockcache_helpers import BLOCK, block_data, key
from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.tier import Tier

root = sys.argv[1]
cache = TieredBlockCache(
    os.path.join(root, "index"),
    [TierConfig("ram", os.path.join(root, "ram"), 4 * BLOCK),
     TierConfig("ssd", os.path.join(root, "ssd"), 4 * BLOCK)],
)
for i in range(6):
    cache.put(key(i), block_data(i))
# What a crash between writing a block file and committing its index entry leaves behind: a
# complete file with no entry, and a half-written temp file.
orphan = key(99)
ssd = Tier(TierConfig("ssd", os.path.join(root, "ssd"), 4 * BLOCK), tier_id=1)
ssd.write_block(orphan.raw, 12345, block_data(99))
with open(os.path.join(ssd.root, "tmp", orphan.hex + ".partial"), "wb") as partial:
    partial.write(b"half")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_after_a_crash_orphan_and_temp_files_are_removed_and_the_rest_is_warm(make_cache, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CRASHING_CHILD), str(tmp_path)],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert block_files_du(str(tmp_path / "ssd")) == 3 * BLOCK  # 2 blocks + the orphan

    cache = make_cache(ram=4 * BLOCK, ssd=4 * BLOCK)

    assert not cache.contains(key(99))
    assert os.listdir(tmp_path / "ssd" / "tmp") == []
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used
    assert [cache.locate(key(i)) for i in range(6)] == ["ram"] * 4 + ["ssd"] * 2
    for i in range(6):
        assert cache.read(key(i)) == block_data(i)


def test_an_unreadable_index_is_rebuilt_empty_and_the_stale_files_removed(make_cache, tmp_path):
    cache = make_cache()
    for i in range(3):
        cache.put(key(i), block_data(i))
    cache.close()
    with open(tmp_path / "index" / "data.mdb", "wb") as index_file:
        index_file.write(b"\0garbage" * 1000)

    cache = make_cache()

    assert not any(cache.contains(key(i)) for i in range(3))
    assert cache.usage()[0].used == 0
    assert block_files_du(str(tmp_path / "ram")) == 0
    assert cache.put(key(0), block_data(0)) == "ram"
    assert cache.read(key(0)) == block_data(0)
