"""The state store contract, run against both backends: LMDB in a temporary directory and etcd
(the session's ``etcd`` fixture, a fresh key prefix per test). Backend-specific behaviour
(durability, etcd failover and timeouts, location parsing) follows the shared tests."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.errors import ConfigError
from coordinator.state import (
    EtcdStateStore,
    LmdbStateStore,
    StateStore,
    StateStoreError,
    open_state_store,
)
from tests.fakes.etcd import EtcdServer
from tests.fakes.moto import free_port


def unique_prefix() -> str:
    return f"/test-{uuid.uuid4().hex}/"


@pytest.fixture(params=["lmdb", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "lmdb":
        opened: StateStore = LmdbStateStore(tmp_path / "state")
    else:
        server: EtcdServer = request.getfixturevalue("etcd")
        opened = EtcdStateStore([server.endpoint], prefix=unique_prefix())
    try:
        yield opened
    finally:
        opened.close()


# --- the contract, for both backends ---------------------------------------------------------


def test_get_put_delete(store: StateStore) -> None:
    assert store.get("datasets/imagenet") is None
    store.put("datasets/imagenet", b'{"v": 1}')
    assert store.get("datasets/imagenet") == b'{"v": 1}'
    store.put("datasets/imagenet", b'{"v": 2}')
    assert store.get("datasets/imagenet") == b'{"v": 2}'
    assert store.delete("datasets/imagenet") is True
    assert store.delete("datasets/imagenet") is False
    assert store.get("datasets/imagenet") is None


def test_empty_value_is_not_a_missing_key(store: StateStore) -> None:
    # etcd's JSON leaves empty fields out: an empty value must still read back as b"".
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.list("emp") == [("empty", b"")]


def test_list_by_prefix_sorted(store: StateStore) -> None:
    keys = ["a/c", "a/bc", "b", "a/b", "a/b/c", "datasets/ünï/日本", "datasets/z"]
    for key in keys:
        store.put(key, key.encode())
    assert [key for key, _ in store.list("a/b")] == ["a/b", "a/b/c", "a/bc"]
    assert store.list("a/b/") == [("a/b/c", b"a/b/c")]
    assert store.list("datasets/ü") == [("datasets/ünï/日本", "datasets/ünï/日本".encode())]
    assert [key for key, _ in store.list("")] == sorted(keys)
    assert store.list("nothing/") == []


def test_put_if_absent(store: StateStore) -> None:
    assert store.put_if_absent("jobs/1", b"first") is True
    assert store.put_if_absent("jobs/1", b"second") is False
    assert store.get("jobs/1") == b"first"


def test_compare_and_put(store: StateStore) -> None:
    assert store.compare_and_put("copy", b"anything", b"v1") is False  # missing key
    assert store.get("copy") is None
    assert store.compare_and_put("copy", None, b"v1") is True
    assert store.compare_and_put("copy", None, b"v2") is False  # exists
    assert store.compare_and_put("copy", b"stale", b"v2") is False
    assert store.get("copy") == b"v1"
    assert store.compare_and_put("copy", b"v1", b"v2") is True
    assert store.get("copy") == b"v2"


def test_value_of_a_megabyte(store: StateStore) -> None:
    value = os.urandom(1_000_000)
    store.put("big", value)
    assert store.get("big") == value


def test_concurrent_compare_and_put_counts_exactly(store: StateStore) -> None:
    threads, increments = 8, 15
    store.put("counter", b"0")

    def increment() -> None:
        for _ in range(increments):
            while True:
                current = store.get("counter")
                assert current is not None
                if store.compare_and_put("counter", current, b"%d" % (int(current) + 1)):
                    break

    workers = [threading.Thread(target=increment) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert store.get("counter") == b"%d" % (threads * increments)


# --- LMDB ------------------------------------------------------------------------------------


def test_lmdb_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state"
    first = LmdbStateStore(path)
    first.put("datasets/a", b"kept")
    first.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    second = LmdbStateStore(path)
    try:
        assert second.get("datasets/a") == b"kept"
    finally:
        second.close()


def test_lmdb_errors_name_the_store(tmp_path: Path) -> None:
    store = LmdbStateStore(tmp_path / "state")
    try:
        with pytest.raises(StateStoreError, match=re.escape(f"lmdb:{tmp_path}")):
            store.put("k" * 600, b"LMDB keys are at most 511 bytes")
    finally:
        store.close()


# --- etcd ------------------------------------------------------------------------------------


def test_etcd_survives_crash_and_restart() -> None:
    with EtcdServer() as server:
        store = EtcdStateStore([server.endpoint], timeout_s=5.0)
        try:
            store.put("datasets/a", b"kept")
            server.kill()
            with pytest.raises(StateStoreError, match="cannot reach"):
                store.get("datasets/a")
            server.restart()
            assert store.get("datasets/a") == b"kept"
        finally:
            store.close()


def test_etcd_prefixes_keep_stores_apart(etcd: EtcdServer) -> None:
    one = EtcdStateStore([etcd.endpoint], prefix=unique_prefix())
    two = EtcdStateStore([etcd.endpoint], prefix=unique_prefix())
    try:
        one.put("k", b"one")
        assert two.get("k") is None
        assert two.list("") == []
        assert one.list("") == [("k", b"one")]
    finally:
        one.close()
        two.close()


def test_etcd_dead_endpoint_fails_fast_with_a_message() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    store = EtcdStateStore([dead], timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(StateStoreError, match=f"cannot reach any endpoint.*{re.escape(dead)}"):
            store.get("k")
    finally:
        store.close()
    assert time.monotonic() - started < 2.0


def test_etcd_silent_endpoint_times_out() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = EtcdStateStore([endpoint], timeout_s=0.5)
        started = time.monotonic()
        try:
            expected = re.escape(f"{endpoint}: put failed: ReadTimeout")
            with pytest.raises(StateStoreError, match=expected):
                store.put("k", b"v")
        finally:
            store.close()
        assert time.monotonic() - started < 2.0


def test_etcd_fails_over_to_a_live_endpoint(etcd: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    store = EtcdStateStore([dead, etcd.endpoint], prefix=unique_prefix())
    try:
        store.put("k", b"v")
        assert store.get("k") == b"v"
        assert store.list("") == [("k", b"v")]
    finally:
        store.close()


def test_etcd_error_replies_carry_etcds_message(etcd: EtcdServer) -> None:
    store = EtcdStateStore([etcd.endpoint], prefix=unique_prefix())
    try:
        # Over etcd's default 1.5 MiB request limit.
        with pytest.raises(StateStoreError, match=r"HTTP 400.*request is too large"):
            store.put("huge", bytes(2_000_000))
    finally:
        store.close()


# --- open_state_store ------------------------------------------------------------------------


def test_open_lmdb_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_state_store(f"lmdb://{tmp_path}/a")
    assert isinstance(store, LmdbStateStore)
    assert store.where == f"lmdb:{tmp_path}/a"
    store.close()
    store = open_state_store(str(tmp_path / "b"))
    assert store.where == f"lmdb:{tmp_path}/b"
    store.close()
    monkeypatch.chdir(tmp_path)
    store = open_state_store("relative")
    assert store.where == f"lmdb:{tmp_path}/relative"
    store.close()


@pytest.mark.parametrize("scheme", ["etcd://", "etcd+http://"])
def test_open_etcd_locations(etcd: EtcdServer, scheme: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    live = etcd.location.removeprefix("etcd://")
    store = open_state_store(f"{scheme}{dead},{live}")
    assert isinstance(store, EtcdStateStore)
    assert store.where == f"etcd:http://{dead},http://{live}"
    try:
        key = f"test-{uuid.uuid4().hex}"
        store.put(key, b"v")
        assert store.get(key) == b"v"
        assert store.delete(key) is True
    finally:
        store.close()


@pytest.mark.parametrize(
    "location",
    [
        "",
        "ftp://x",
        "lmdb://relative/path",
        "etcd://",
        "etcd://host:port",
        "etcd://host:2379/path",
        "etcd://a:1,,b:2",
        "etcd://user:secret@host:2379",
    ],
)
def test_open_rejects_bad_locations(location: str) -> None:
    with pytest.raises(ConfigError) as caught:
        open_state_store(location)
    assert "secret" not in str(caught.value)
