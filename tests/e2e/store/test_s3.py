"""S3Store against a real S3 HTTP endpoint (moto server), with the fault proxy in between for
request counting and injected failures (503 SlowDown, resets, cut bodies, a dead store).

Nothing is mocked: botocore talks HTTP to moto over loopback.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.errors import (
    ObjectChanged,
    ObjectNotFound,
    StoreBucketNotFound,
    StoreIOError,
    StoreUnavailable,
)
from cachefs.store import s3
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.s3 import S3Store, make_session
from cachefs.store.s3_bulk import USER_AGENT as S3_BULK_USER_AGENT
from tests.fakes.moto import free_port

# Quick retries so that the retry tests take milliseconds, and a deadline far beyond them.
# Quick backoffs, but a generous budget and first-byte timeout: no hedge (after 30 s of
# silence) can add a GET to the exact counts below on a loaded machine.
FAST_RETRY = RetryPolicy(
    attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=120.0, first_byte_timeout_s=60.0
)
BIG_OBJECT = bytes(range(256)) * 1031  # 263,936 bytes, every offset distinguishable-ish


def make_store(endpoint: str, uri: str, **overrides) -> S3Store:
    page_size = overrides.pop("page_size", 1000)
    lean_gets = overrides.pop("lean_gets", True)
    config = StoreConfig(
        uri=uri,
        endpoint=endpoint,
        dataset="ds",
        retry=overrides.pop("retry", FAST_RETRY),
        **overrides,
    )
    return S3Store(config, page_size=page_size, lean_gets=lean_gets)


@pytest.fixture(params=[True, False], ids=["lean-gets", "boto3-gets"])
def lean_gets(request) -> bool:
    """GETs through the lean client (the default) and through botocore: both must behave."""
    return request.param


@pytest.fixture(scope="module")
def bucket(moto_s3):
    name = moto_s3.make_bucket()
    moto_s3.put(name, "data/big.bin", BIG_OBJECT)
    moto_s3.put(name, "data/small.txt", b"hello")
    moto_s3.put(name, "data/empty", b"")
    moto_s3.put(name, "other/outside.txt", b"not in the dataset")
    return name


@pytest.fixture(scope="module")
def store(moto_s3, bucket):
    store = make_store(moto_s3.endpoint, f"s3://{bucket}/data")
    yield store
    store.close()


def test_list_yields_keys_relative_to_the_prefix_with_size_and_etag(store, moto_s3, bucket):
    listed = {info.key: info for info in store.list()}

    assert sorted(listed) == ["big.bin", "empty", "small.txt"]
    assert listed["small.txt"].size == 5
    assert listed["small.txt"].etag == hashlib.md5(b"hello").hexdigest()
    assert listed["big.bin"].size == len(BIG_OBJECT)
    assert listed["empty"].size == 0
    assert listed["big.bin"].mtime_ns > 0
    assert listed["big.bin"].mtime_ns % 1000 == 0  # whole microseconds: no float rounding
    # cachefs parses LIST timestamps itself (s3.parse_timestamp): the same instants as
    # botocore's own parser gives a plain client.
    page = moto_s3.client().list_objects_v2(Bucket=bucket, Prefix="data/")
    for entry in page["Contents"]:
        expected = int(entry["LastModified"].timestamp() * 1_000_000) * 1000
        assert listed[entry["Key"].removeprefix("data/")].mtime_ns == expected


def test_listing_parses_each_timestamp_with_cachefs_parser(moto_s3, bucket, monkeypatch):
    """The sessions of a store parse response timestamps with s3.parse_timestamp, not
    botocore's dateutil parser (~40 µs each: most of a LIST page's CPU; bench/s3_list.py)."""
    parsed, original = [], s3.parse_timestamp

    def counting(text):
        parsed.append(text)
        return original(text)

    monkeypatch.setattr(s3, "parse_timestamp", counting)
    listing = make_store(moto_s3.endpoint, f"s3://{bucket}/data")  # sessions made now
    try:
        assert len(list(listing.list())) == 3
    finally:
        listing.close()
    assert len(parsed) >= 3


def test_list_paginates_and_keeps_utf8_byte_order(moto_s3):
    bucket = moto_s3.make_bucket()
    # U+FF21 sorts before U+1F600 in UTF-8 but after it in UTF-16: the order must be UTF-8's.
    keys = [f"k{i:02d}" for i in range(17)] + ["a b", "dir/", "é", "\uff21", "\U0001f600"]
    keys.append("ctrl\x01char")  # not representable in XML 1.0: needs EncodingType=url
    for key in keys:
        moto_s3.put(bucket, "p/" + key, key.encode())
    store = make_store(moto_s3.endpoint, f"s3://{bucket}/p/", page_size=4)

    listed = [info.key for info in store.list()]

    assert listed == sorted(keys, key=lambda key: key.encode())


def test_list_with_a_relative_prefix(moto_s3):
    bucket = moto_s3.make_bucket()
    for key in ("ds/train/a", "ds/train/b", "ds/trainx", "ds/val/c"):
        moto_s3.put(bucket, key, b"x")
    store = make_store(moto_s3.endpoint, f"s3://{bucket}/ds/", page_size=1)

    assert [info.key for info in store.list("train/")] == ["train/a", "train/b"]
    assert [info.key for info in store.list("train")] == ["train/a", "train/b", "trainx"]


def test_head_returns_what_list_returns(store):
    listed = {info.key: info for info in store.list()}

    assert store.head("small.txt") == listed["small.txt"]
    assert store.head("big.bin") == listed["big.bin"]


def test_get_range_returns_exact_bytes(store):
    assert store.get_range("small.txt", 0, 5) == b"hello"
    assert store.get_range("small.txt", 1, 3) == b"ell"
    assert store.get_range("big.bin", len(BIG_OBJECT) - 7, 7) == BIG_OBJECT[-7:]
    assert store.get_range("empty", 0, 0) == b""


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_get_range_is_byte_exact_for_any_range(store, data):
    offset = data.draw(st.integers(0, len(BIG_OBJECT) - 1), label="offset")
    length = data.draw(st.integers(1, len(BIG_OBJECT) - offset), label="length")

    assert store.get_range("big.bin", offset, length) == BIG_OBJECT[offset : offset + length]


def test_get_range_with_the_current_etag_succeeds(store):
    etag = store.head("small.txt").etag

    assert store.get_range("small.txt", 0, 2, etag=etag) == b"he"


def test_get_range_of_a_changed_object_raises_object_changed(moto_s3, lean_gets):
    bucket = moto_s3.make_bucket()
    old_etag = moto_s3.put(bucket, "ds/f", b"version one")
    store = make_store(moto_s3.endpoint, f"s3://{bucket}/ds", lean_gets=lean_gets)
    moto_s3.put(bucket, "ds/f", b"version two")

    with pytest.raises(ObjectChanged) as caught:
        store.get_range("f", 0, 4, etag=old_etag)

    assert "'ds'" in str(caught.value) and "'f'" in str(caught.value)
    assert "refresh" in str(caught.value)


def test_missing_key_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound, match="'nope'"):
        store.head("nope")
    with pytest.raises(ObjectNotFound, match="'nope'"):
        store.get_range("nope", 0, 1)


def test_missing_bucket_raises_bucket_not_found(moto_s3):
    store = make_store(moto_s3.endpoint, "s3://no-such-bucket-here/x")

    with pytest.raises(StoreBucketNotFound) as caught:
        list(store.list())

    message = str(caught.value)
    assert "no-such-bucket-here" in message and moto_s3.endpoint in message


def test_transient_503s_are_retried_until_success(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    fault_proxy.fail_next(2, status=503)  # SlowDown, SlowDown, then the real answer

    assert store.get_range("small.txt", 0, 5) == b"hello"
    assert fault_proxy.count("GET", path_contains="small.txt") == 3


def test_listing_pages_are_retried_individually(fault_proxy, moto_s3):
    bucket = moto_s3.make_bucket()
    for i in range(5):
        moto_s3.put(bucket, f"p/{i}", b"x")
    store = make_store(fault_proxy.url, f"s3://{bucket}/p", page_size=2)
    listing = store.list()
    first = next(listing)
    fault_proxy.fail_next(1, status=500)  # the second page fails once

    rest = list(listing)

    assert [first.key] + [info.key for info in rest] == ["0", "1", "2", "3", "4"]
    assert fault_proxy.count("GET") == 4  # 3 pages + 1 failed try


def test_503_forever_gives_up_at_the_deadline_with_store_unavailable(
    fault_proxy, bucket, lean_gets
):
    # Many attempts allowed, but a short deadline: the deadline must be what stops it. (Seconds
    # for a loaded machine to make two tries; a try is hedged only if silent for 5 s.)
    retry = RetryPolicy(
        attempts=1000,
        base_delay_s=0.05,
        max_delay_s=0.1,
        deadline_s=10.0,
        first_byte_timeout_s=60.0,
    )
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets, retry=retry)
    fault_proxy.fail_matching("small.txt", status=503, code="ServiceUnavailable")

    with pytest.raises(StoreUnavailable) as caught:
        store.get_range("small.txt", 0, 5)

    tries = int(re.search(r"after (\d+) tries", str(caught.value)).group(1))
    assert 1 < tries < 1000
    # Every try reached the store, but perhaps the last, which the deadline may have overtaken.
    assert tries - 1 <= fault_proxy.count("GET", path_contains="small.txt") <= tries
    assert "503 ServiceUnavailable" in str(caught.value)


def test_connection_refused_is_store_unavailable_after_the_attempts(bucket):
    dead_endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = make_store(dead_endpoint, f"s3://{bucket}/data")

    with pytest.raises(StoreUnavailable) as caught:
        store.head("small.txt")

    assert "Connection refused" in str(caught.value)
    assert f"after {FAST_RETRY.attempts} tries" in str(caught.value)


def test_connection_reset_is_retried(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    fault_proxy.reset_next(2)

    assert store.get_range("big.bin", 10, 100) == BIG_OBJECT[10:110]
    assert fault_proxy.count("GET") == 3


def test_a_body_cut_short_is_retried(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    fault_proxy.truncate_next(1, keep_bytes=1000)

    assert store.get_range("big.bin", 0, 200_000) == BIG_OBJECT[:200_000]
    assert fault_proxy.count("GET") == 2


def test_a_body_always_cut_short_is_an_io_error_never_short_data(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    fault_proxy.truncate_next(FAST_RETRY.attempts, keep_bytes=1000)

    with pytest.raises(StoreIOError):
        store.get_range("big.bin", 0, 200_000)


def test_a_store_ignoring_the_range_header_is_an_io_error_at_once(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    fault_proxy.ignore_range_next(1)

    with pytest.raises(StoreIOError, match="ignore the Range header"):
        store.get_range("big.bin", 0, 1000)
    assert fault_proxy.count("GET") == 1  # not retried: another try would not do better


def test_a_hung_store_times_out_as_store_unavailable(fault_proxy, bucket, lean_gets):
    store = make_store(
        fault_proxy.url,
        f"s3://{bucket}/data",
        lean_gets=lean_gets,
        retry=RetryPolicy(attempts=2, base_delay_s=0.01, first_byte_timeout_s=0.3),
    )
    fault_proxy.blackhole(method="GET")

    with pytest.raises(StoreUnavailable, match="after 2 tries"):
        store.get_range("small.txt", 0, 5)


def test_a_stopped_then_restarted_store_is_used_again(fault_proxy, bucket, lean_gets):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=lean_gets)
    assert store.get_range("small.txt", 0, 5) == b"hello"  # leaves a kept-alive connection

    fault_proxy.stop()
    with pytest.raises(StoreUnavailable):
        store.get_range("small.txt", 0, 5)
    fault_proxy.start()

    assert store.get_range("small.txt", 0, 5) == b"hello"


def test_the_store_is_safe_to_share_between_threads(store):
    ranges = [(i * 1000, 1000 + i) for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: store.get_range("big.bin", *r), ranges))

    assert results == [BIG_OBJECT[off : off + n] for off, n in ranges]


def test_gets_go_through_the_lean_client_by_default_and_the_rest_through_botocore(
    fault_proxy, bucket
):
    store = make_store(fault_proxy.url, f"s3://{bucket}/data")
    assert store.get_range("small.txt", 0, 5) == b"hello"
    store.head("small.txt")
    assert fault_proxy.user_agents("GET", path_contains="small.txt") == {S3_BULK_USER_AGENT}
    head_agents = fault_proxy.user_agents("HEAD", path_contains="small.txt")
    assert head_agents and S3_BULK_USER_AGENT not in head_agents
    switched_off = make_store(fault_proxy.url, f"s3://{bucket}/data", lean_gets=False)
    assert switched_off.get_range("small.txt", 1, 3) == b"ell"
    assert len(fault_proxy.user_agents("GET", path_contains="small.txt")) == 2


def test_stores_share_one_model_loader_and_read_with_it(moto_s3, bucket):
    """botocore's JSON models are parsed once per process, not once per store: every session
    (each dataset add or refresh opens stores) shares one loader, and stores opened after the
    first read their bytes through it."""
    moto_s3.put(bucket, "shared.bin", b"the same bytes")
    stores = [make_store(moto_s3.endpoint, f"s3://{bucket}/") for _ in range(2)]
    try:
        for store in stores:
            assert store.get_range("shared.bin", 4, 4) == b"same"
        loaders = {
            id(make_session(StoreConfig(uri=f"s3://{bucket}/")).get_component("data_loader"))
            for _ in range(2)
        }
        assert len(loaders) == 1
    finally:
        for store in stores:
            store.close()
