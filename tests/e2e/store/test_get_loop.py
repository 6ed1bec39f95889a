"""The fetcher processes' GET loop (cachefs/store/get_loop.py, run by
cachefs/cluster/fetchers.py ``serve``) against a real S3 endpoint (moto) behind the fault
proxy: blocks of hostile keys byte for byte, into files and back through the pipe; and every
fault a first try in the loop can meet — a reset, a body cut short, a stall mid-body longer
than the policy's bound, a 503 SlowDown, a missing object — ends byte-exactly or with the
ordinary read path's own error, the loop's try having been handed over to it."""

from __future__ import annotations

import pytest

from cachefs.cache.base import block_checksums
from cachefs.cluster.fetchers import FetcherPool, FetchFailed
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.s3 import S3Store
from cachefs.store.s3_bulk import USER_AGENT
from tests.waiting import WAIT_S

KEYS = ["plain.bin", "with space/ü 日本.bin", "percent/100%25+plus~.bin", "q?x=1#f.bin"]
# Quick retries; a try silent for 1 s mid-body (the attempt timeout) is given up.
RETRY = RetryPolicy(attempts=5, base_delay_s=0.01, max_delay_s=0.05, first_byte_timeout_s=1.0)


@pytest.fixture
def source(moto_s3, fault_proxy):
    bucket = moto_s3.make_bucket()
    objects = {key: f"{key}:".encode() * (3000 + 700 * n) for n, key in enumerate(KEYS)}
    for key, data in objects.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    config = StoreConfig(f"s3://{bucket}/ds", endpoint=fault_proxy.url, retry=RETRY)
    store = S3Store(config)
    etags = {key: store.head(key).etag for key in objects}
    store.close()
    pool = FetcherPool(1)
    yield config, objects, etags, pool
    pool.close()


def test_blocks_of_hostile_keys_come_back_byte_for_byte(source, fault_proxy, tmp_path):
    config, objects, etags, pool = source
    fault_proxy.reset_counts()
    futures = {}
    for key, data in objects.items():  # all in flight at once
        for offset in (0, 17):
            length = len(data) - offset
            into = str(tmp_path / f"{len(futures)}.blk")
            futures[(key, offset, into)] = pool.start_into(
                config, key, offset, length, etags[key], into
            )
            futures[(key, offset, None)] = pool.start(config, key, offset, length, etags[key])
    for (key, offset, into), future in futures.items():
        result = future.result(timeout=WAIT_S)
        expected = objects[key][offset:]
        if into is None:
            assert result.data == expected
        else:
            with open(into, "rb") as written:
                assert written.read() == expected
            assert (result.checksum, result.chunk_checksums) == block_checksums(expected)
        assert not result.throttled
    assert fault_proxy.count("GET", path_contains="/ds/") == len(futures)  # one try each
    assert set(fault_proxy.user_agents("GET", path_contains="/ds/")) == {USER_AGENT}


@pytest.mark.parametrize("fault", ["reset", "truncate", "stall", "slowdown"])
def test_a_first_try_the_loop_cannot_finish_is_retried_by_the_ordinary_path(
    source, fault_proxy, tmp_path, fault
):
    config, objects, etags, pool = source
    key = KEYS[1]
    data = objects[key]
    if fault == "reset":
        fault_proxy.reset_next(1, path_contains="/ds/")
    elif fault == "truncate":
        fault_proxy.truncate_next(1, keep_bytes=1000, path_contains="/ds/")
    elif fault == "stall":  # longer than the attempt timeout, in the middle of the body
        fault_proxy.stall_next(1, 3.0, after_bytes=1000, path_contains="/ds/")
    else:
        fault_proxy.fail_next(1, status=503, code="SlowDown", path_contains="/ds/")
    fault_proxy.reset_counts()
    into = str(tmp_path / "block")
    result = pool.start_into(config, key, 5, len(data) - 5, etags[key], into).result(timeout=WAIT_S)
    with open(into, "rb") as written:
        assert written.read() == data[5:]
    assert (result.checksum, result.chunk_checksums) == block_checksums(data[5:])
    assert result.throttled == (fault == "slowdown")  # what the adaptive limit is told
    assert fault_proxy.count("GET", path_contains="/ds/") == 2  # the loop's try, then one more


def test_a_missing_object_fails_with_the_stores_own_error(source):
    config, _objects, etags, pool = source
    with pytest.raises(FetchFailed) as failure:
        pool.fetch(config, "gone ü.bin", 0, 10, etags[KEYS[0]])
    assert failure.value.kind == "ObjectNotFound"
    store = S3Store(config)
    try:
        with pytest.raises(Exception) as direct:
            store.get_range("gone ü.bin", 0, 10, etag=etags[KEYS[0]])
    finally:
        store.close()
    assert str(failure.value) == str(direct.value)  # the same one line as S3Store's


def test_which_requests_go_to_the_loop(source, tmp_path):
    """The small blocks of sources read with the lean client, once a thread has opened it
    (opening may wait on the network: never on the loop's thread); the rest go to threads."""
    from cachefs.cluster.fetchers import LOOP_MAX_BYTES, _loop_reader, fetch_range
    from cachefs.store.s3_bulk import S3BulkReader

    config, objects, etags, _pool = source
    local = StoreConfig(f"file://{tmp_path}")
    try:
        assert _loop_reader((config, "k", 0, 100, "e"), True) is None  # not opened yet
        data, _ = fetch_range(config, KEYS[0], 0, 10, etags[KEYS[0]])  # a thread's first GET
        assert data == objects[KEYS[0]][:10]
        assert isinstance(_loop_reader((config, "k", 0, 100, "e"), True), S3BulkReader)
        assert isinstance(_loop_reader((config, "k", 0, LOOP_MAX_BYTES, "e"), True), S3BulkReader)
        assert _loop_reader((config, "k", 0, LOOP_MAX_BYTES + 1, "e"), True) is None
        assert _loop_reader((config, "k", 0, 100, "e"), False) is None  # boto3
        assert _loop_reader((local, "k", 0, 100, "e"), True) is None
    finally:
        from cachefs.cluster import fetchers

        for store in fetchers._stores.values():
            store.close()
        fetchers._stores.clear()
