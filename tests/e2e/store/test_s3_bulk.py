"""The lean bulk-GET client (cachefs/store/s3_bulk.py) against a real S3 endpoint (moto server),
with the fault proxy in between for request counting and injected failures.

Each behaviour is checked against S3Store's on the same objects: the same bytes, and for every
failure the same error class and the same one-line message. moto checks SigV4 signatures only
once its IAM authentication is switched on (``MotoServer.require_auth``), so the credential
tests run on a server of their own with it on: there a wrongly signed request (an unknown key,
a wrong secret, a key quoted differently in the URL than in the signature) is refused by a
real signature check, and every correctly signed one is served.
"""

from __future__ import annotations

import hashlib

import pytest

from cachefs.cluster import fetchers
from cachefs.errors import (
    ObjectChanged,
    ObjectNotFound,
    StoreAuthError,
    StoreError,
    StoreIOError,
    StoreThrottled,
)
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.s3 import S3Store
from cachefs.store.s3_bulk import USER_AGENT, BulkClientUnsupported, S3BulkReader
from tests.fakes.moto import MotoServer

# Quick backoffs, a generous budget and first-byte timeout: no hedge (after 30 s of silence)
# can add a GET to the exact counts below on a loaded machine.
FAST_RETRY = RetryPolicy(
    attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=120.0, first_byte_timeout_s=60.0
)
NO_RETRY = RetryPolicy(attempts=1)
BIG_OBJECT = bytes(range(256)) * 1031  # 263,936 bytes
WRONG_SECRET = "wrong-secret-that-must-never-be-printed"
# Keys that a URL must quote: spaces, non-ASCII, "%", "+", "~", "//", "..", "?", "#", "=".
HOSTILE_KEYS = [
    "with space/a b.bin",
    "ünïcödé/日本語.bin",
    "percent/100%25 %41.bin",
    "plus/a+b+c.bin",
    "tilde~and//double/../dots.bin",
    "query?x=1&y=2#frag;semi,comma=eq.bin",
]


def config_for(endpoint: str, bucket: str, retry: RetryPolicy = FAST_RETRY) -> StoreConfig:
    return StoreConfig(f"s3://{bucket}/data", endpoint=endpoint, dataset="ds", retry=retry)


@pytest.fixture(scope="module")
def bucket(moto_s3):
    name = moto_s3.make_bucket()
    moto_s3.put(name, "data/big.bin", BIG_OBJECT)
    for index, key in enumerate(HOSTILE_KEYS):
        moto_s3.put(name, f"data/{key}", f"{index}:{key}".encode() * 100)
    return name


@pytest.fixture
def both(moto_s3, bucket):
    """The lean reader and S3Store's botocore path for the same dataset, straight to moto."""
    config = config_for(moto_s3.endpoint, bucket)
    reader, store = S3BulkReader(config), S3Store(config, lean_gets=False)
    yield reader, store
    reader.close()
    store.close()


def failure(read) -> StoreError:
    with pytest.raises(StoreError) as caught:
        read()
    return caught.value


def test_full_and_ranged_reads_are_byte_exact(both):
    reader, store = both
    etag = store.head("big.bin").etag
    size = len(BIG_OBJECT)
    assert reader.get_range("big.bin", 0, size, etag=etag) == BIG_OBJECT
    for offset, length in [(0, 1), (1, 255), (4095, 4097), (size - 7, 7), (100_000, 123_457)]:
        expected = BIG_OBJECT[offset : offset + length]
        assert reader.get_range("big.bin", offset, length, etag=etag) == expected
        assert reader.get_range("big.bin", offset, length) == expected  # no etag: no If-Match
    assert reader.get_range("big.bin", 5, 0) == b""


def test_hostile_keys_read_the_same_bytes_as_s3store(both):
    reader, store = both
    for key in HOSTILE_KEYS:
        info = store.head(key)
        whole = store.get_range(key, 0, info.size, etag=info.etag)
        assert reader.get_range(key, 0, info.size, etag=info.etag) == whole, key
        assert reader.get_range(key, 3, 50, etag=info.etag) == whole[3:53], key


def test_a_missing_key_is_object_not_found_like_s3store(both):
    reader, store = both
    lean, sdk = (
        failure(lambda: reader.get_range("no/such key", 0, 10)),
        failure(lambda: store.get_range("no/such key", 0, 10)),
    )
    assert isinstance(lean, ObjectNotFound)
    assert str(lean) == str(sdk)


def test_a_changed_object_is_object_changed_like_s3store(both):
    reader, store = both
    stale = hashlib.md5(b"an older version").hexdigest()
    lean = failure(lambda: reader.get_range("big.bin", 0, 10, etag=stale))
    sdk = failure(lambda: store.get_range("big.bin", 0, 10, etag=stale))
    assert isinstance(lean, ObjectChanged)
    assert str(lean) == str(sdk)


def test_slowdown_503s_are_retried_counted_and_then_succeed(fault_proxy, bucket):
    reader = S3BulkReader(config_for(fault_proxy.url, bucket))
    try:
        fault_proxy.fail_next(2, status=503, path_contains="big.bin")
        assert reader.get_range("big.bin", 10, 20) == BIG_OBJECT[10:30]
        assert fault_proxy.count("GET", path_contains="big.bin") == 3
        assert reader.throttled_tries == 2  # the adaptive limits' signal
        assert fault_proxy.user_agents("GET", path_contains="big.bin") == {USER_AGENT}
    finally:
        reader.close()


def test_slowdown_every_time_gives_up_as_store_throttled_like_s3store(fault_proxy, bucket):
    config = config_for(fault_proxy.url, bucket, retry=NO_RETRY)
    reader, store = S3BulkReader(config), S3Store(config, lean_gets=False)
    try:
        fault_proxy.fail_next(2, status=503, path_contains="big.bin")
        lean = failure(lambda: reader.get_range("big.bin", 0, 1))
        sdk = failure(lambda: store.get_range("big.bin", 0, 1))
        assert isinstance(lean, StoreThrottled)
        assert "HTTP 503 SlowDown" in str(lean)
        # The same line, but for the seconds spent ("... after 1 try in 0.0 s").
        assert str(lean).rsplit(" in ", 1)[0] == str(sdk).rsplit(" in ", 1)[0]
    finally:
        reader.close()
        store.close()


def test_a_body_cut_short_is_retried_and_never_returned(fault_proxy, bucket):
    reader = S3BulkReader(config_for(fault_proxy.url, bucket))
    try:
        fault_proxy.truncate_next(1, keep_bytes=1000, path_contains="big.bin")
        assert reader.get_range("big.bin", 0, 200_000) == BIG_OBJECT[:200_000]
        assert fault_proxy.count("GET", path_contains="big.bin") == 2
        fault_proxy.truncate_next(10, keep_bytes=1000, path_contains="big.bin")
        error = failure(lambda: reader.get_range("big.bin", 0, 200_000))
        assert isinstance(error, StoreIOError) and "cut short" in str(error)
    finally:
        fault_proxy.clear_faults()
        reader.close()


def test_a_store_ignoring_the_range_header_is_an_io_error_at_once(fault_proxy, bucket):
    reader = S3BulkReader(config_for(fault_proxy.url, bucket))
    try:
        fault_proxy.ignore_range_next(1, path_contains="big.bin")
        error = failure(lambda: reader.get_range("big.bin", 0, 10))
        assert isinstance(error, StoreIOError) and "ignore the Range header" in str(error)
        assert fault_proxy.count("GET", path_contains="big.bin") == 1
    finally:
        reader.close()


def test_a_configured_http_proxy_is_left_to_boto3(moto_s3, bucket, monkeypatch):
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    config = config_for(moto_s3.endpoint, bucket)
    with pytest.raises(BulkClientUnsupported, match="proxy"):
        S3BulkReader(config)
    store = fetchers._open(config, lean_s3=True)  # what a fetcher process opens then
    try:
        assert isinstance(store, S3Store)
    finally:
        store.close()


def test_prepare_reads_opens_the_lean_client_before_the_first_read(moto_s3, bucket, monkeypatch):
    """A dataset add calls prepare_reads (cachefs/datasets.py): the tens of ms of building the
    lean client then come before the first block read instead of inside it."""
    opened = []
    real_init = S3BulkReader.__init__

    def counting_init(self, *args, **kwargs):
        opened.append(args[0])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(S3BulkReader, "__init__", counting_init)
    store = S3Store(config_for(moto_s3.endpoint, bucket))
    try:
        assert opened == []  # not when the store opens: a listing-only store never pays it
        store.prepare_reads()
        assert len(opened) == 1
        assert store.get_range("big.bin", 1000, 5000) == BIG_OBJECT[1000:6000]
        store.prepare_reads()
        assert len(opened) == 1  # the read, and a second prepare, used the one client
    finally:
        store.close()


# --- credentials: a moto server of its own, checking SigV4 signatures ---------------------------


@pytest.fixture(scope="module")
def auth_server():
    server = MotoServer()
    server.start()
    try:
        bucket = server.make_bucket()
        for key in ["data/file.txt", *(f"data/{key}" for key in HOSTILE_KEYS)]:
            server.put(bucket, key, b"authenticated bytes of " + key.encode())
        key_id, secret = server.require_auth()
        yield server, bucket, key_id, secret
    finally:
        server.stop()


def test_valid_credentials_are_signed_right_for_every_key(auth_server, monkeypatch):
    server, bucket, key_id, secret = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    reader = S3BulkReader(config_for(server.endpoint, bucket, retry=NO_RETRY))
    try:
        for key in ["file.txt", *HOSTILE_KEYS]:
            expected = b"authenticated bytes of data/" + key.encode()
            assert reader.get_range(key, 0, len(expected)) == expected, key
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("access_key", "code"),
    [("AKIAUNKNOWNKEY000000", "InvalidAccessKeyId"), (None, "SignatureDoesNotMatch")],
)
def test_rejected_credentials_give_s3stores_line_without_the_secret(
    auth_server, monkeypatch, access_key, code
):
    server, bucket, key_id, _ = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key or key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    config = config_for(server.endpoint, bucket, retry=NO_RETRY)
    reader, store = S3BulkReader(config), S3Store(config, lean_gets=False)
    try:
        lean = failure(lambda: reader.get_range("file.txt", 0, 5))
        sdk = failure(lambda: store.get_range("file.txt", 0, 5))
    finally:
        reader.close()
        store.close()
    assert isinstance(lean, StoreAuthError)
    assert f"credentials rejected by S3: {code}" in str(lean)
    assert str(lean) == str(sdk)
    assert WRONG_SECRET not in str(lean) and "\n" not in str(lean)


def test_no_credentials_at_all_give_s3stores_line(auth_server, monkeypatch):
    server, bucket, _, _ = auth_server
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = config_for(server.endpoint, bucket, retry=NO_RETRY)
    # The lean reader signs a probe when it opens, so it says it then; S3Store at its first GET.
    lean = failure(lambda: S3BulkReader(config))
    store = S3Store(config, lean_gets=False)
    try:
        sdk = failure(lambda: store.get_range("file.txt", 0, 5))
    finally:
        store.close()
    # Preparing the reads of such a store says nothing; its first read says it.
    prepared = S3Store(config)
    try:
        prepared.prepare_reads()
        assert str(failure(lambda: prepared.get_range("file.txt", 0, 5))) == str(lean)
    finally:
        prepared.close()
    assert isinstance(lean, StoreAuthError) and "AWS_ACCESS_KEY_ID" in str(lean)
    # The same line but for the key (none named when opening).
    assert (lean.cause, lean.dataset, lean.store) == (sdk.cause, sdk.dataset, sdk.store)
    # A fetcher answers a fetch with that line and its kind (it does not hang on a store it
    # cannot open).
    data, throttled = fetchers.fetch_range(config, "file.txt", 0, 5, "etag", lean_s3=True)
    assert data == fetchers.Failure("StoreAuthError", str(lean)) and not throttled
