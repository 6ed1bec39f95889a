"""TieredBlockCache: data path, capacity, admission policies, reserve, removal, promotion.

Everything is real: LMDB index and tier directories under tmp_path, real threads.
Restart, crash and corruption behaviour is in test_tiered_cache_recovery.py.
"""

from __future__ import annotations

import os
import random
import stat
import threading

import pytest

from cachefs.cache import CacheClosed, TierConfig, TieredBlockCache, tiered
from cachefs.errors import ConfigError
from tests.unit.cache.blockcache_helpers import BLOCK, block_data, block_files_du, key


def usage_of(cache: TieredBlockCache, tier_name: str):
    return next(usage for usage in cache.usage() if usage.name == tier_name)


# --- data path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 777, BLOCK, 3 * BLOCK + 1])
def test_put_then_read_returns_the_exact_bytes(make_cache, size):
    cache = make_cache()
    data = block_data(7, size)

    assert cache.put(key(7), data) == "ram"

    assert cache.read(key(7)) == data
    assert cache.locate(key(7)) == "ram"
    assert cache.contains(key(7))
    path = cache.block_path(key(7))
    with open(path, "rb") as block_file:
        assert block_file.read() == data
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_unknown_block_is_absent(make_cache):
    cache = make_cache()
    assert cache.read(key(1)) is None
    assert cache.locate(key(1)) is None
    assert not cache.contains(key(1))
    assert cache.block_path(key(1)) is None


def test_partial_reads_return_the_requested_range(make_cache):
    cache = make_cache()
    data = block_data(3, 1000)
    cache.put(key(3), data)
    ranges = [(0, 10), (10, 1), (999, 1), (500, -1), (990, 100), (1000, 5), (2000, 5), (0, 0)]
    for _round in range(2):  # every read is checked the same way, the first and later ones
        for offset, length in ranges:
            expected = data[offset:] if length < 0 else data[offset : offset + length]
            assert cache.read(key(3), offset, length) == expected, (offset, length)


def test_bad_read_range_is_refused_with_a_clear_error(make_cache):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    with pytest.raises(ValueError, match="offset=-1"):
        cache.read(key(1), -1, 10)
    with pytest.raises(ValueError, match="length=-2"):
        cache.read(key(1), 0, -2)


def test_putting_a_cached_block_again_changes_nothing(make_cache):
    cache = make_cache()
    assert cache.put(key(1), block_data(1)) == "ram"
    assert cache.put(key(1), block_data(1)) == "ram"
    assert cache.counters().admitted == 1
    assert usage_of(cache, "ram").used == BLOCK


def test_concurrent_puts_of_one_key_store_it_once(make_cache, tmp_path):
    cache = make_cache()
    threads_count = 16
    start = threading.Barrier(threads_count)
    results = []

    def put_same_block() -> None:
        start.wait()
        results.append(cache.put(key(5), block_data(5)))

    threads = [threading.Thread(target=put_same_block) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert results == ["ram"] * threads_count
    assert cache.counters().admitted == 1
    assert usage_of(cache, "ram").blocks == 1
    assert block_files_du(str(tmp_path / "ram")) == BLOCK
    assert cache.read(key(5)) == block_data(5)


# --- capacity -----------------------------------------------------------------------------------


def _put_concurrently(cache: TieredBlockCache, threads_count: int, blocks_per_thread: int):
    """Many threads put distinct blocks of varied sizes (some larger than a block)."""
    start = threading.Barrier(threads_count)
    errors: list[BaseException] = []

    def worker(thread_no: int) -> None:
        rng = random.Random(thread_no)
        start.wait()
        try:
            for n in range(blocks_per_thread):
                index = thread_no * 1000 + n
                cache.put(key(index), block_data(index, rng.randint(1, 3 * BLOCK)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_count)]
    for thread in threads:
        thread.start()
    return threads, errors


def _watch_until_done(threads, check) -> int:
    """Run ``check()`` repeatedly while the threads work; return how often it ran."""
    checks = 0
    while any(thread.is_alive() for thread in threads):
        check()
        checks += 1
    for thread in threads:
        thread.join()
    check()
    return checks + 1


def test_capacity_is_never_exceeded_under_concurrent_puts_avoid_eviction(make_cache, tmp_path):
    ram_capacity, ssd_capacity = 20 * BLOCK, 30 * BLOCK
    cache = make_cache(ram=ram_capacity, ssd=ssd_capacity)
    threads, errors = _put_concurrently(cache, threads_count=8, blocks_per_thread=40)

    def check() -> None:
        # Without eviction files only ever appear, so a directory walk never over-counts.
        assert block_files_du(str(tmp_path / "ram")) <= ram_capacity
        assert block_files_du(str(tmp_path / "ssd")) <= ssd_capacity
        for usage in cache.usage():
            assert usage.used <= usage.capacity

    assert _watch_until_done(threads, check) >= 1
    assert not errors
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used <= usage.capacity
    counters = cache.counters()
    assert counters.refused > 0  # the workload is larger than the cache
    assert counters.admitted == sum(usage.blocks for usage in cache.usage())


def test_capacity_is_never_exceeded_under_concurrent_puts_lru(make_cache):
    cache = make_cache(ram=20 * BLOCK, ssd=30 * BLOCK, admission="lru")
    threads, errors = _put_concurrently(cache, threads_count=8, blocks_per_thread=40)

    def check() -> None:
        for usage in cache.usage():
            assert usage.used <= usage.capacity

    _watch_until_done(threads, check)
    assert not errors
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used <= usage.capacity
    counters = cache.counters()
    assert counters.evicted > 0
    assert counters.admitted - counters.evicted == sum(usage.blocks for usage in cache.usage())


def test_a_block_larger_than_a_tier_goes_to_a_tier_that_can_hold_it(make_cache):
    cache = make_cache(ram=2 * BLOCK, ssd=8 * BLOCK)
    assert cache.put(key(1), block_data(1, 3 * BLOCK)) == "ssd"
    assert cache.put(key(2), block_data(2, 9 * BLOCK)) is None
    assert cache.counters().refused == 1


def test_zero_capacity_tier_admits_only_empty_blocks(make_cache):
    cache = make_cache(ram=0)
    assert cache.put(key(1), b"") == "ram"
    assert cache.put(key(2), b"x") is None


# --- admission policies -------------------------------------------------------------------------


def test_avoid_eviction_fills_tiers_in_order_then_refuses_and_keeps_what_it_has(make_cache):
    cache = make_cache(ram=2 * BLOCK, ssd=3 * BLOCK)
    placed = [cache.put(key(i), block_data(i)) for i in range(7)]

    assert placed == ["ram", "ram", "ssd", "ssd", "ssd", None, None]
    assert cache.counters().refused == 2
    assert cache.counters().evicted == 0
    for i in range(5):
        assert cache.read(key(i)) == block_data(i)
    assert cache.read(key(5)) is None


def test_lru_evicts_the_least_recently_used_block(make_cache):
    cache = make_cache(ram=4 * BLOCK, admission="lru")
    for i in range(4):
        cache.put(key(i), block_data(i))
    assert cache.read(key(0)) == block_data(0)  # 0 is now more recent than 1, 2, 3
    cache.block_path(key(1))  # a short-circuit reader's access counts too

    assert cache.put(key(4), block_data(4)) == "ram"
    assert not cache.contains(key(2))
    assert cache.put(key(5), block_data(5)) == "ram"
    assert not cache.contains(key(3))
    assert all(cache.contains(key(i)) for i in (0, 1, 4, 5))
    assert cache.counters().evicted == 2


def test_lru_fills_free_room_in_every_tier_before_evicting(make_cache):
    cache = make_cache(ram=2 * BLOCK, ssd=2 * BLOCK, admission="lru")
    placed = [cache.put(key(i), block_data(i)) for i in range(4)]
    assert placed == ["ram", "ram", "ssd", "ssd"]
    assert cache.counters().evicted == 0
    assert cache.put(key(4), block_data(4)) == "ram"  # the first tier is preferred for eviction
    assert not cache.contains(key(0))


def test_lru_never_evicts_the_reserve(make_cache):
    cache = make_cache(ram=4 * BLOCK, ram_reserve=2 * BLOCK, admission="lru")
    for i in range(10):
        assert cache.put(key(i), block_data(i)) == "ram"

    # Blocks 0 and 1 were admitted first: reserved, kept although they are the oldest.
    assert [i for i in range(10) if cache.contains(key(i))] == [0, 1, 8, 9]
    ram = usage_of(cache, "ram")
    assert (ram.used, ram.reserved_used, ram.blocks) == (4 * BLOCK, 2 * BLOCK, 4)


def test_lru_falls_to_the_next_tier_when_the_first_holds_only_reserved_blocks(make_cache):
    cache = make_cache(ram=2 * BLOCK, ram_reserve=2 * BLOCK, ssd=2 * BLOCK, admission="lru")
    for i in range(4):
        cache.put(key(i), block_data(i))

    assert cache.put(key(4), block_data(4)) == "ssd"
    assert [i for i in range(5) if cache.contains(key(i))] == [0, 1, 3, 4]


def test_lru_refuses_when_nothing_can_be_evicted(make_cache):
    cache = make_cache(ram=2 * BLOCK, ram_reserve=2 * BLOCK, admission="lru")
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))
    assert cache.put(key(2), block_data(2)) is None
    assert cache.counters().refused == 1


def test_evict_lru_frees_non_reserved_blocks_oldest_first(make_cache):
    cache = make_cache(ram=8 * BLOCK, ram_reserve=2 * BLOCK)
    for i in range(6):
        cache.put(key(i), block_data(i))
    cache.read(key(2))

    assert cache.evict_lru("ram", BLOCK + 1) == 2 * BLOCK  # whole blocks: 3 and 4
    assert [i for i in range(6) if cache.contains(key(i))] == [0, 1, 2, 5]

    # Even "evict everything" leaves the reserve in place.
    assert cache.evict_lru("ram", 100 * BLOCK) == 2 * BLOCK
    assert [i for i in range(6) if cache.contains(key(i))] == [0, 1]
    ram = usage_of(cache, "ram")
    assert (ram.used, ram.reserved_used) == (2 * BLOCK, 2 * BLOCK)
    assert cache.counters().evicted == 4


def test_evict_lru_of_one_source_leaves_other_sources_alone(make_cache):
    cache = make_cache(ram=8 * BLOCK)
    for i in range(3):
        cache.put(key(i, source_id=1), block_data(i))
        cache.put(key(i, source_id=2), block_data(i))

    assert cache.evict_lru("ram", 100 * BLOCK, source_id=2) == 3 * BLOCK
    assert cache.cached_bytes(1) == 3 * BLOCK
    assert cache.cached_bytes(2) == 0


def test_evict_lru_names_an_unknown_tier(make_cache):
    cache = make_cache()
    with pytest.raises(ConfigError, match="'nvme' does not exist"):
        cache.evict_lru("nvme", BLOCK)


def _hit_ratios_of_cyclic_epochs(cache, blocks: int, epochs: int, reshuffle: bool) -> list[float]:
    """Read a dataset epoch after epoch in shuffled order, caching each miss (like the
    filesystem does); return the hit ratio of each epoch."""
    rng = random.Random(1234)
    order = list(range(blocks))
    ratios = []
    for epoch in range(epochs):
        if reshuffle or epoch == 0:
            rng.shuffle(order)
        hits = 0
        for i in order:
            if cache.read(key(i)) is not None:
                hits += 1
            else:
                cache.put(key(i), block_data(i))
        ratios.append(hits / blocks)
    return ratios


@pytest.mark.parametrize("reshuffle", [True, False], ids=["reshuffled", "same-order"])
def test_cache_thrash_avoid_eviction_keeps_its_hit_ratio_where_lru_collapses(
    make_cache, tmp_path, reshuffle
):
    """A dataset twice the cache's size read for 3 epochs: avoid-eviction keeps half of it and
    hits ~capacity/size from the second epoch on; lru keeps replacing what the epoch will need
    next (CoorDL's cache thrashing) and hits far less — nothing at all in a fixed order."""
    blocks = 200
    capacity = blocks // 2 * BLOCK
    with TieredBlockCache(
        str(tmp_path / "avoid-index"), [TierConfig("ram", str(tmp_path / "avoid"), capacity)]
    ) as avoid:
        avoid_ratios = _hit_ratios_of_cyclic_epochs(avoid, blocks, 3, reshuffle)
    with TieredBlockCache(
        str(tmp_path / "lru-index"),
        [TierConfig("ram", str(tmp_path / "lru"), capacity)],
        admission="lru",
    ) as lru:
        lru_ratios = _hit_ratios_of_cyclic_epochs(lru, blocks, 3, reshuffle)

    assert avoid_ratios[0] == lru_ratios[0] == 0.0
    for epoch in (1, 2):
        assert avoid_ratios[epoch] == pytest.approx(0.5, abs=0.02)
        assert lru_ratios[epoch] < 0.3
        if not reshuffle:
            assert lru_ratios[epoch] == 0.0


def test_concurrent_reads_puts_and_evictions_never_return_wrong_bytes(make_cache):
    """Readers race with lru evictions, promotions and explicit removals of the same blocks:
    every read returns the right bytes or None, and the accounting ends up matching the disk."""
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
                action = rng.random()
                if action < 0.1:
                    cache.evict(key(i))
                    continue
                offset, length = rng.choice([(0, -1), (rng.randrange(BLOCK), rng.randrange(64))])
                got = cache.read(key(i), offset, length)
                if got is None:
                    cache.put(key(i), block_data(i))
                else:
                    end = BLOCK if length < 0 else offset + length
                    if got != block_data(i)[offset:end]:
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
    counters = cache.counters()
    assert counters.evicted > 0
    assert counters.corrupt == counters.missing == 0
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used <= usage.capacity
        assert usage.blocks == sum(cache.locate(key(i)) == usage.name for i in range(30))


# --- removal ------------------------------------------------------------------------------------


def test_evict_removes_one_block_and_its_file(make_cache):
    cache = make_cache(ram=8 * BLOCK, ram_reserve=8 * BLOCK)
    cache.put(key(1), block_data(1))
    path = cache.block_path(key(1))

    assert cache.evict(key(1)) == BLOCK  # explicit removal ignores the reserve
    assert cache.evict(key(1)) == 0
    assert not os.path.exists(path)
    assert usage_of(cache, "ram").used == 0
    assert usage_of(cache, "ram").reserved_used == 0
    assert cache.counters().evicted == 0  # removal, not eviction


def test_evict_source_removes_every_block_of_that_source(make_cache):
    cache = make_cache(ram=6 * BLOCK, ssd=6 * BLOCK)
    for i in range(5):
        cache.put(key(i, source_id=1), block_data(i))
        cache.put(key(i, source_id=2), block_data(i, 100))
    assert cache.cached_bytes(1) == 5 * BLOCK
    assert cache.cached_bytes(2) == 500

    assert cache.evict_source(1) == 5 * BLOCK
    assert cache.cached_bytes(1) == 0
    assert not any(cache.contains(key(i, source_id=1)) for i in range(5))
    assert all(cache.read(key(i, source_id=2)) == block_data(i, 100) for i in range(5))
    assert sum(usage.used for usage in cache.usage()) == 5 * BLOCK  # 100 bytes take a page
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used
    assert cache.evict_source(1) == 0


def test_free_blocks_keeps_the_reserve_and_other_sources(make_cache):
    cache = make_cache(ram=4 * BLOCK, ram_reserve=2 * BLOCK, ssd=4 * BLOCK, ssd_reserve=BLOCK)
    for i in range(7):  # ram: 0,1 reserved, 2,3; ssd: 4 reserved, 5, 6
        cache.put(key(i, source_id=1), block_data(i))
    cache.put(key(7, source_id=2), block_data(7))  # ssd
    paths = {i: cache.block_path(key(i, source_id=1)) for i in range(7)}

    assert cache.free_blocks(1) == 4 * BLOCK
    kept = [i for i in range(7) if cache.contains(key(i, source_id=1))]
    assert kept == [0, 1, 4]
    assert all(cache.read(key(i, source_id=1)) == block_data(i) for i in kept)
    assert not any(os.path.exists(paths[i]) for i in (2, 3, 5, 6))
    assert cache.read(key(7, source_id=2)) == block_data(7)
    assert cache.counters().evicted == 4  # cleanup counts as eviction
    assert cache.cached_bytes(1) == 3 * BLOCK
    for usage in cache.usage():
        assert block_files_du(usage.path) == usage.used
    assert (usage_of(cache, "ram").used, usage_of(cache, "ssd").used) == (2 * BLOCK, 2 * BLOCK)
    assert cache.free_blocks(1) == 0  # only the reserve is left
    assert cache.free_blocks(99) == 0  # a source with nothing cached


def test_free_blocks_of_some_shards_only(make_cache):
    cache = make_cache(ram=40 * BLOCK, ram_reserve=3 * BLOCK)
    keys = [key(i, source_id=1) for i in range(30)]
    for i, k in enumerate(keys):
        cache.put(k, block_data(i))
    cache.put(key(0, source_id=2), block_data(0))  # same shard as keys[0], another source
    shards = sorted({k.shard for k in keys})
    chosen = set(shards[::2]) | {5000}  # a shard number with nothing cached is no problem
    expected_gone = [i for i, k in enumerate(keys) if k.shard in chosen and i >= 3]

    freed = cache.free_blocks(1, chosen)

    assert freed == len(expected_gone) * BLOCK
    for i, k in enumerate(keys):
        assert cache.contains(k) == (i not in expected_gone), i
    assert cache.contains(key(0, source_id=2))
    assert cache.free_blocks(1, set()) == 0
    assert cache.counters().evicted == len(expected_gone)


def test_free_blocks_in_small_batches_steps_over_reserved_blocks(make_cache, monkeypatch):
    """Batches resume after the last key looked at: reserved blocks, which stay, are neither
    freed nor walked again and again, and the loop ends."""
    monkeypatch.setattr(tiered, "_REMOVE_BATCH", 2)
    cache = make_cache(ram=40 * BLOCK, ram_reserve=10 * BLOCK)
    for i in range(25):
        cache.put(key(i, source_id=1), block_data(i))

    assert cache.free_blocks(1) == 15 * BLOCK
    assert [i for i in range(25) if cache.contains(key(i, source_id=1))] == list(range(10))
    # A shard filter goes through the same batches.
    for i in range(25, 40):
        cache.put(key(i, source_id=1), block_data(i))
    shards = {key(i, source_id=1).shard for i in range(25, 40)}
    assert cache.free_blocks(1, shards) == 15 * BLOCK
    assert cache.cached_bytes(1) == 10 * BLOCK


def test_cached_bytes_by_shard_follows_admissions_removals_and_reopens(make_cache):
    """What heartbeats report per shard: kept in step with every change, and rebuilt from the
    index when the cache is opened again."""
    cache = make_cache(ram=20 * BLOCK)
    keys = [key(i, source_id=1) for i in range(10)]
    for i, k in enumerate(keys):
        cache.put(k, block_data(i))
    cache.put(key(0, source_id=2), block_data(0))
    expected: dict[int, int] = {}
    for k in keys:
        expected[k.shard] = expected.get(k.shard, 0) + BLOCK
    assert cache.cached_bytes_by_shard(1) == expected
    assert sum(cache.cached_bytes_by_shard(2).values()) == BLOCK

    cache.evict(keys[0])
    expected[keys[0].shard] -= BLOCK
    expected = {shard: n for shard, n in expected.items() if n}
    assert cache.cached_bytes_by_shard(1) == expected
    cache.close()
    assert make_cache(ram=20 * BLOCK).cached_bytes_by_shard(1) == expected


# --- promotion ----------------------------------------------------------------------------------


def test_no_promotion_by_default(make_cache):
    cache = make_cache(ram=1 * BLOCK, ssd=4 * BLOCK)
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))
    cache.evict(key(0))  # RAM has room again

    assert cache.read(key(1)) == block_data(1)
    assert cache.locate(key(1)) == "ssd"


def test_promotion_moves_a_block_read_from_ssd_into_ram_when_ram_has_room(make_cache, tmp_path):
    cache = make_cache(ram=1 * BLOCK, ssd=4 * BLOCK, promote=True)
    cache.put(key(0), block_data(0))
    cache.put(key(1), block_data(1))
    cache.put(key(2), block_data(2))
    ssd_path = cache.block_path(key(1))

    # RAM is full: promotion never evicts, the block stays on SSD.
    assert cache.read(key(1), 10, 20) == block_data(1)[10:30]
    assert cache.locate(key(1)) == "ssd"

    cache.evict(key(0))
    assert cache.read(key(1), 10, 20) == block_data(1)[10:30]
    assert cache.locate(key(1)) == "ram"
    assert not os.path.exists(ssd_path)
    assert cache.read(key(1)) == block_data(1)
    assert [(usage.name, usage.used, usage.blocks) for usage in cache.usage()] == [
        ("ram", BLOCK, 1),
        ("ssd", BLOCK, 1),
    ]
    assert block_files_du(str(tmp_path / "ssd")) == BLOCK


# --- configuration and lifecycle ----------------------------------------------------------------


def test_bad_configuration_is_refused_with_a_clear_error(tmp_path):
    index = str(tmp_path / "index")
    ram = TierConfig("ram", str(tmp_path / "ram"), BLOCK)
    with pytest.raises(ConfigError, match="admission policy 'fifo'"):
        TieredBlockCache(index, [ram], admission="fifo")
    with pytest.raises(ConfigError, match="at least one tier"):
        TieredBlockCache(index, [])
    with pytest.raises(ConfigError, match="differ in name"):
        TieredBlockCache(index, [ram, TierConfig("ram", str(tmp_path / "other"), BLOCK)])
    with pytest.raises(ConfigError, match="differ in directory"):
        TieredBlockCache(index, [ram, TierConfig("ssd", str(tmp_path / "ram"), BLOCK)])
    with pytest.raises(ConfigError, match="'ssd': reserve must be between 0 and the capacity"):
        TierConfig("ssd", str(tmp_path / "ssd"), BLOCK, reserve=2 * BLOCK)
    with pytest.raises(ConfigError, match="'ssd': capacity"):
        TierConfig("ssd", str(tmp_path / "ssd"), -1)


def test_a_closed_cache_says_so(make_cache):
    cache = make_cache()
    cache.put(key(1), block_data(1))
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(CacheClosed, match="is closed"):
        cache.read(key(1))
    with pytest.raises(CacheClosed, match="is closed"):
        cache.put(key(2), block_data(2))
