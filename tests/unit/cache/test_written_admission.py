"""TieredBlockCache: admitting blocks another process wrote (reserve, admit_written, abandon).

The preload's fetcher processes write a block straight into a reservation's file and hand back
its checksums (cachefs/cluster/pipeline.py); here the test writes those files itself, with the
same function the fetchers use. Real LMDB and tier directories under tmp_path.
"""

from __future__ import annotations

import os
import threading

from cachefs.cache.base import checksum, chunk_checksums
from cachefs.cache.tier import write_new_file
from tests.unit.cache.blockcache_helpers import BLOCK, block_data, key
from tests.waiting import WAIT_S, wait_for


def free_room(cache, tier: str = "ram") -> int:
    usage = next(u for u in cache.usage() if u.name == tier)
    return usage.capacity - usage.used


def written(cache, index: int, data: bytes):
    """Reserve room for ``data``, write it as a fetcher would, admit it."""
    reservation = cache.reserve(key(index), len(data))
    assert reservation is not None
    write_new_file(reservation.path, data)
    return reservation, cache.admit_written(reservation, checksum(data), chunk_checksums(data))


def test_a_written_block_reads_back_byte_for_byte_and_counts_like_a_put(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    data = block_data(1, BLOCK - 5)
    reservation, tier = written(cache, 1, data)

    assert tier == "ram"
    assert cache.read(key(1)) == data
    assert not os.path.exists(reservation.path)  # renamed into place
    assert free_room(cache) == 4 * BLOCK - reservation.footprint
    assert cache.counters().admitted == 1


def test_a_reservation_holds_room_until_admitted_or_abandoned(make_cache):
    cache = make_cache(ram=2 * BLOCK)
    first = cache.reserve(key(1), BLOCK)
    second = cache.reserve(key(2), BLOCK)
    assert first is not None and second is not None

    assert cache.reserve(key(3), BLOCK) is None  # both blocks' room is taken: refused
    assert cache.counters().refused == 1
    write_new_file(second.path, block_data(2, BLOCK))  # a fetcher wrote it, then was stopped
    cache.abandon(second)
    cache.abandon(first)  # nothing was written for this one

    assert not os.path.exists(second.path)
    assert cache.reserve(key(3), BLOCK) is not None  # the room came back
    assert cache.read(key(2)) is None


def test_a_written_file_of_the_wrong_size_is_not_admitted_and_gives_its_room_back(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    data = block_data(1, BLOCK)
    reservation = cache.reserve(key(1), len(data))
    write_new_file(reservation.path, data[:-1])  # torn: one byte short

    assert cache.admit_written(reservation, checksum(data), chunk_checksums(data)) is None
    assert cache.read(key(1)) is None
    assert not os.path.exists(reservation.path)
    assert free_room(cache) == 4 * BLOCK


def test_a_reservation_whose_file_was_never_written_is_not_admitted(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    reservation = cache.reserve(key(1), BLOCK)
    data = block_data(1, BLOCK)

    assert cache.admit_written(reservation, checksum(data), chunk_checksums(data)) is None
    assert free_room(cache) == 4 * BLOCK


def test_checksums_that_do_not_match_the_written_bytes_make_the_block_unreadable(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    data = block_data(1, BLOCK)
    reservation = cache.reserve(key(1), len(data))
    write_new_file(reservation.path, data)
    other = block_data(2, BLOCK)
    cache.admit_written(reservation, checksum(other), chunk_checksums(other))

    assert cache.read(key(1)) is None  # verified against what was recorded: dropped, never served
    assert cache.counters().corrupt == 1


def test_a_block_written_twice_is_admitted_once(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    data = block_data(1, BLOCK)
    first, tier = written(cache, 1, data)
    second, again = written(cache, 1, data)

    assert (tier, again) == ("ram", "ram")
    assert not os.path.exists(second.path)
    assert cache.usage()[0].blocks == 1
    assert free_room(cache) == 4 * BLOCK - first.footprint
    assert cache.read(key(1)) == data


def test_a_put_and_a_written_block_of_one_key_store_it_once(make_cache):
    cache = make_cache(ram=4 * BLOCK)
    data = block_data(1, BLOCK)
    reservation = cache.reserve(key(1), len(data))
    write_new_file(reservation.path, data)
    assert cache.put(key(1), data) == "ram"

    assert cache.admit_written(reservation, checksum(data), chunk_checksums(data)) == "ram"
    assert cache.usage()[0].blocks == 1
    assert free_room(cache) == 4 * BLOCK - reservation.footprint


def test_a_batch_is_admitted_block_by_block_and_a_bad_file_fails_alone(make_cache):
    cache = make_cache(ram=8 * BLOCK)
    datas = [block_data(i, BLOCK - i) for i in range(4)]
    reservations = [cache.reserve(key(i), len(data)) for i, data in enumerate(datas)]
    for i, (reservation, data) in enumerate(zip(reservations, datas, strict=True)):
        write_new_file(reservation.path, data if i != 2 else data[:10])  # block 2 is torn
    batch = [(r, checksum(d), chunk_checksums(d)) for r, d in zip(reservations, datas, strict=True)]

    assert cache.admit_written_many(batch) == ["ram", "ram", None, "ram"]
    for i in (0, 1, 3):
        assert cache.read(key(i)) == datas[i]
    assert cache.read(key(2)) is None
    assert cache.usage()[0].blocks == 3
    assert free_room(cache) == 8 * BLOCK - sum(reservations[i].footprint for i in (0, 1, 3))


def test_a_key_twice_in_one_batch_is_admitted_once(make_cache):
    cache = make_cache(ram=8 * BLOCK)
    data = block_data(1, BLOCK)
    first, second = cache.reserve(key(1), len(data)), cache.reserve(key(1), len(data))
    for reservation in (first, second):
        write_new_file(reservation.path, data)
    sums = (checksum(data), chunk_checksums(data))

    assert cache.admit_written_many([(first, *sums), (second, *sums)]) == ["ram", "ram"]
    assert cache.usage()[0].blocks == 1
    assert free_room(cache) == 8 * BLOCK - first.footprint
    assert not os.path.exists(second.path)


def test_a_batch_waits_for_another_writer_only_after_admitting_its_own_blocks(make_cache):
    """Another writer holds key 2 (claimed here through the cache's own claim, as a put or
    another batch in progress would). The batch [1, 2] admits key 1 and lets go of it before it
    waits for key 2: a batch that waited holding key 1 would deadlock with one holding key 2
    and waiting for key 1."""
    cache = make_cache(ram=8 * BLOCK)
    datas = {i: block_data(i, BLOCK) for i in (1, 2)}
    batch = []
    for i, data in datas.items():
        reservation = cache.reserve(key(i), len(data))
        write_new_file(reservation.path, data)
        batch.append((reservation, checksum(data), chunk_checksums(data)))
    assert cache._claim(key(2).raw) is None  # the other writer of key 2
    results: list = []
    admitting = threading.Thread(target=lambda: results.extend(cache.admit_written_many(batch)))
    admitting.start()
    try:
        wait_for(lambda: cache.locate(key(1)) == "ram", "key 1 admitted while key 2 is held")
        assert cache._claim(key(1).raw) is None  # not held by the waiting batch
        cache._release_claim(key(1).raw)
    finally:
        cache._release_claim(key(2).raw)  # the other writer ends without storing it
    admitting.join(WAIT_S)
    assert not admitting.is_alive()
    assert results == ["ram", None]
    assert cache.read(key(1)) == datas[1]
    assert cache.usage()[0].blocks == 1
    assert free_room(cache) == 8 * BLOCK - batch[0][0].footprint
