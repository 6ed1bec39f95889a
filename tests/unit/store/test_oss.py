"""OSSStore through the real oss2 SDK against the fake OSS endpoint (tests/fakes/oss_server.py,
whose docstring says why a fake is needed here and what it implements: V1 signature checks,
ListObjects V1/V2, HEAD, ranged GET with If-Match, OSS error bodies).

Transient failures are injected by the fault proxy in front of the fake server.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import oss2
import pytest

from cachefs.errors import (
    ConfigError,
    ObjectChanged,
    ObjectNotFound,
    StoreAuthError,
    StoreBucketNotFound,
    StoreIOError,
    StoreUnavailable,
)
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.oss import OSSStore
from tests.fakes.fault_proxy import FaultProxy
from tests.fakes.moto import free_port

# Quick backoffs, but a generous budget and first-byte timeout: no hedge (after 30 s of
# silence) can add a GET to the exact counts below on a loaded machine.
FAST_RETRY = RetryPolicy(
    attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=120.0, first_byte_timeout_s=60.0
)
DATA = bytes(range(256)) * 40


@pytest.fixture
def oss_env(oss_server, monkeypatch):
    for name, value in oss_server.env.items():
        monkeypatch.setenv(name, value)


def make_store(endpoint: str, uri: str, **overrides) -> OSSStore:
    page_size = overrides.pop("page_size", 1000)
    config = StoreConfig(
        uri=uri,
        endpoint=endpoint,
        dataset="ds",
        retry=overrides.pop("retry", FAST_RETRY),
        **overrides,
    )
    return OSSStore(config, page_size=page_size)


def test_list_paginates_in_utf8_order_relative_to_the_prefix(oss_server, oss_env):
    keys = [f"k{i:02d}" for i in range(11)] + ["a b", "a+b", "dir/", "é", "\uff21", "\U0001f600"]
    for key in keys:
        oss_server.put("bkt", "p/" + key, key.encode())
    oss_server.put("bkt", "other", b"outside the prefix")
    store = make_store(oss_server.endpoint, "oss://bkt/p", page_size=3)

    listed = list(store.list())

    assert [info.key for info in listed] == sorted(keys, key=lambda key: key.encode())
    first = listed[0]
    assert first.size == len(first.key.encode())
    assert first.etag == hashlib.md5(first.key.encode()).hexdigest().upper()
    assert first.mtime_ns % 1_000_000_000 == 0 and first.mtime_ns > 0


def test_list_with_a_relative_prefix(oss_server, oss_env):
    for key in ("ds/train/a", "ds/train/b", "ds/trainx", "ds/val/c"):
        oss_server.put("bkt", key, b"x")
    store = make_store(oss_server.endpoint, "oss://bkt/ds/", page_size=1)

    assert [info.key for info in store.list("train/")] == ["train/a", "train/b"]


def test_head_matches_the_listing(oss_server, oss_env):
    oss_server.put("bkt", "ds/f.bin", DATA, last_modified=1_700_000_000)
    store = make_store(oss_server.endpoint, "oss://bkt/ds")

    info = store.head("f.bin")

    assert info == next(iter(store.list()))
    assert info.size == len(DATA)
    assert info.mtime_ns == 1_700_000_000 * 1_000_000_000


def test_get_range_is_byte_exact(oss_server, oss_env):
    oss_server.put("bkt", "ds/f.bin", DATA)
    store = make_store(oss_server.endpoint, "oss://bkt/ds")

    for offset, length in [(0, 1), (0, len(DATA)), (5, 300), (len(DATA) - 1, 1), (1000, 7)]:
        assert store.get_range("f.bin", offset, length) == DATA[offset : offset + length]


def test_get_range_checks_the_etag(oss_server, oss_env):
    etag = oss_server.put("bkt", "ds/f.bin", b"version one")
    store = make_store(oss_server.endpoint, "oss://bkt/ds")
    assert store.get_range("f.bin", 0, 7, etag=etag) == b"version"

    oss_server.put("bkt", "ds/f.bin", b"version two")

    with pytest.raises(ObjectChanged, match=r"'f\.bin'"):
        store.get_range("f.bin", 0, 7, etag=etag)


def test_missing_key_and_missing_bucket(oss_server, oss_env):
    oss_server.create_bucket("bkt")
    store = make_store(oss_server.endpoint, "oss://bkt/ds")

    with pytest.raises(ObjectNotFound):
        store.head("nope")
    with pytest.raises(ObjectNotFound):
        store.get_range("nope", 0, 1)
    with pytest.raises(StoreBucketNotFound, match="no-such-bucket"):
        list(make_store(oss_server.endpoint, "oss://no-such-bucket/ds").list())


def test_an_unknown_access_key_is_rejected_without_leaking_the_secret(oss_server, monkeypatch):
    oss_server.put("bkt", "ds/f", b"x")
    monkeypatch.setenv("OSS_ACCESS_KEY_ID", "unknown-id")
    monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", "secret-that-must-not-leak")
    store = make_store(oss_server.endpoint, "oss://bkt/ds")

    with pytest.raises(StoreAuthError) as caught:
        list(store.list())

    assert "credentials rejected by OSS: InvalidAccessKeyId" in str(caught.value)
    assert "secret-that-must-not-leak" not in str(caught.value)


def test_a_wrong_secret_is_rejected_on_every_operation(oss_server, monkeypatch):
    oss_server.put("bkt", "ds/f", b"x")
    monkeypatch.setenv("OSS_ACCESS_KEY_ID", oss_server.access_key_id)
    monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", "secret-that-must-not-leak")
    store = make_store(oss_server.endpoint, "oss://bkt/ds")

    for operation in (lambda: list(store.list()), lambda: store.get_range("f", 0, 1)):
        with pytest.raises(StoreAuthError, match="SignatureDoesNotMatch") as caught:
            operation()
        assert "secret-that-must-not-leak" not in str(caught.value)
    with pytest.raises(StoreAuthError, match="SignatureDoesNotMatch"):
        store.head("f")  # the code travels in the x-oss-err header for HEAD


def test_credentials_from_a_file_win_over_the_environment(oss_server, monkeypatch, tmp_path):
    oss_server.put("bkt", "ds/f", b"from the file")
    monkeypatch.setenv("OSS_ACCESS_KEY_ID", "unknown-id")
    monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", "wrong")
    credentials = tmp_path / "oss.ini"
    credentials.write_text(
        f"[default]\naccess_key_id = {oss_server.access_key_id}\n"
        f"access_key_secret = {oss_server.access_key_secret}\n"
    )

    store = make_store(oss_server.endpoint, "oss://bkt/ds", credentials_file=str(credentials))

    assert store.get_range("f", 0, 4) == b"from"


def test_a_credentials_file_without_the_secret_is_a_config_error(oss_server, tmp_path):
    credentials = tmp_path / "oss.ini"
    credentials.write_text("[default]\naccess_key_id = someone\n")

    with pytest.raises(ConfigError, match="'access_key_secret' in section \\[default\\]"):
        make_store(oss_server.endpoint, "oss://bkt/ds", credentials_file=str(credentials))


def test_a_malformed_credentials_file_is_reported_without_its_contents(oss_server, tmp_path):
    credentials = tmp_path / "oss.ini"
    credentials.write_text("access_key_secret = secret-that-must-not-leak\n")  # no [section]

    with pytest.raises(ConfigError, match="cannot read the OSS credentials file") as caught:
        make_store(oss_server.endpoint, "oss://bkt/ds", credentials_file=str(credentials))

    assert "secret-that-must-not-leak" not in str(caught.value)
    # nor in a traceback: the parser's own error, which quotes the line, is suppressed
    assert caught.value.__suppress_context__


def test_no_credentials_is_an_auth_error_saying_what_to_set(oss_server, monkeypatch):
    monkeypatch.delenv("OSS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("OSS_ACCESS_KEY_SECRET", raising=False)

    with pytest.raises(StoreAuthError, match="OSS_ACCESS_KEY_ID"):
        make_store(oss_server.endpoint, "oss://bkt/ds")


def test_an_endpoint_or_region_is_required(oss_env):
    with pytest.raises(ConfigError, match="needs an endpoint"):
        OSSStore(StoreConfig(uri="oss://bkt/ds"))

    store = OSSStore(StoreConfig(uri="oss://bkt/ds", region="cn-hangzhou"))
    assert store.description == "oss://bkt/ds/ at https://oss-cn-hangzhou.aliyuncs.com"


def test_transient_errors_are_retried_then_succeed(oss_server, oss_env):
    oss_server.put("bkt", "ds/f", DATA)
    with FaultProxy(oss_server.endpoint) as proxy:
        store = make_store(proxy.url, "oss://bkt/ds")
        proxy.fail_next(1, status=503)
        proxy.reset_next(1)
        proxy.truncate_next(1, keep_bytes=100)

        assert store.get_range("f", 10, 5000) == DATA[10:5010]
        assert proxy.count("GET") == 4


def test_503_forever_is_store_unavailable(oss_server, oss_env):
    oss_server.put("bkt", "ds/f", b"x")
    with FaultProxy(oss_server.endpoint) as proxy:
        proxy.fail_matching("/bkt", status=503, code="ServiceUnavailable")
        store = make_store(proxy.url, "oss://bkt/ds")

        with pytest.raises(StoreUnavailable, match="after 4 tries"):
            list(store.list())


def test_a_body_always_cut_short_is_an_io_error(oss_server, oss_env):
    oss_server.put("bkt", "ds/f", DATA)
    with FaultProxy(oss_server.endpoint) as proxy:
        proxy.truncate_next(FAST_RETRY.attempts, keep_bytes=100)
        store = make_store(proxy.url, "oss://bkt/ds")

        with pytest.raises(StoreIOError, match="cut short"):
            store.get_range("f", 0, 5000)


def test_a_store_ignoring_the_range_header_is_an_io_error_at_once(oss_server, oss_env):
    oss_server.put("bkt", "ds/f", DATA)
    with FaultProxy(oss_server.endpoint) as proxy:
        proxy.ignore_range_next(1)
        store = make_store(proxy.url, "oss://bkt/ds")

        with pytest.raises(StoreIOError, match="ignore the Range header"):
            store.get_range("f", 0, 100)
        assert proxy.count("GET") == 1


def test_connection_refused_is_store_unavailable(oss_env):
    store = make_store(f"http://127.0.0.1:{free_port()}", "oss://bkt/ds")

    with pytest.raises(StoreUnavailable, match="Connection refused"):
        store.head("f")


def test_the_fake_server_refuses_unsatisfiable_ranges_only_when_asked(oss_server):
    # OSS's leniency, which the store defends against with x-oss-range-behavior and a length
    # check: without "standard", a range past the end returns the whole object with 200.
    oss_server.put("bkt", "f", b"0123456789")
    bucket = oss2.Bucket(
        oss2.Auth(oss_server.access_key_id, oss_server.access_key_secret),
        oss_server.endpoint,
        "bkt",
    )

    assert bucket.get_object("f", byte_range=(20, 30)).read() == b"0123456789"
    with pytest.raises(oss2.exceptions.ServerError) as caught:
        bucket.get_object("f", byte_range=(20, 30), headers={"x-oss-range-behavior": "standard"})
    assert caught.value.status == 416


def test_the_fake_server_also_serves_list_objects_v1(oss_server):
    for key in ("a", "b", "c"):
        oss_server.put("bkt", key, b"x")
    bucket = oss2.Bucket(
        oss2.Auth(oss_server.access_key_id, oss_server.access_key_secret),
        oss_server.endpoint,
        "bkt",
    )

    first = bucket.list_objects(max_keys=2)
    second = bucket.list_objects(marker=first.next_marker, max_keys=2)

    assert [o.key for o in first.object_list] == ["a", "b"] and first.is_truncated
    assert [o.key for o in second.object_list] == ["c"] and not second.is_truncated


def test_the_store_is_safe_to_share_between_threads(oss_server, oss_env):
    oss_server.put("bkt", "ds/f", DATA)
    store = make_store(oss_server.endpoint, "oss://bkt/ds")
    ranges = [(i * 100, 50 + i) for i in range(64)]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: store.get_range("f", *r), ranges))
    store.close()

    assert results == [DATA[off : off + n] for off, n in ranges]
