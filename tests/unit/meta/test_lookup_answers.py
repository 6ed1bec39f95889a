"""Snapshot.lookup remembers its answers: a repeated LOOKUP (found or not) reads no LMDB record,
the answers are always those of the snapshot's own data, the table stays bounded, and a closed
snapshot answers nothing."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

import cachefs.meta.snapshot as snapshot_module
from cachefs.meta import ROOT, Snapshot, SnapshotError, build_snapshot
from cachefs.store.base import ObjectInfo

KEYS = [f"dir{d}/file{f:03d}.jpg" for d in range(3) for f in range(40)]


def obj(key: str) -> ObjectInfo:
    return ObjectInfo(key=key, size=len(key), etag=f"etag-{key}", mtime_ns=1)


@pytest.fixture
def snapshot(tmp_path):
    build_snapshot([obj(key) for key in KEYS], tmp_path / "snap")
    snapshot = Snapshot.open(tmp_path / "snap")
    yield snapshot
    snapshot.close()


@pytest.fixture
def records_read(monkeypatch) -> Counter:
    """Counts the LMDB lookups that Snapshot.lookup makes, by (parent, name)."""
    counts: Counter = Counter()
    real_lookup_in = Snapshot._lookup_in

    def counting(snapshot, txn, parent_key, name):
        counts[int.from_bytes(parent_key, "big"), name] += 1
        return real_lookup_in(snapshot, txn, parent_key, name)

    monkeypatch.setattr(Snapshot, "_lookup_in", counting)
    return counts


def expected_entry(snapshot: Snapshot, key: str):
    return snapshot.resolve(key)  # resolve reads LMDB every time


def test_a_repeated_lookup_reads_no_record(snapshot, records_read):
    expected = expected_entry(snapshot, "dir1/file007.jpg")
    dir1 = expected.parent
    records_read.clear()
    for _ in range(3):
        assert snapshot.lookup(ROOT, b"dir1").ino == dir1
        assert snapshot.lookup(dir1, b"file007.jpg") == expected
        assert snapshot.lookup(dir1, b"no-such-file") is None
    assert records_read == {
        (ROOT, b"dir1"): 1,
        (dir1, b"file007.jpg"): 1,
        (dir1, b"no-such-file"): 1,
    }


def test_answers_stay_right_while_the_table_is_emptied_when_full(snapshot, monkeypatch):
    monkeypatch.setattr(snapshot_module, "LOOKUPS_KEPT", 5)
    dirs = {d: snapshot.lookup(ROOT, f"dir{d}".encode()).ino for d in range(3)}
    for _round in range(2):
        for key in KEYS:
            d, name = key.split("/")
            parent = dirs[int(d[3:])]
            assert snapshot.lookup(parent, name.encode()) == expected_entry(snapshot, key)
            assert snapshot.lookup(parent, name.encode() + b"x") is None
            assert len(snapshot._lookups) <= 5


def test_threads_share_the_answers_and_get_the_right_ones(snapshot, monkeypatch):
    monkeypatch.setattr(snapshot_module, "LOOKUPS_KEPT", 16)
    dirs = {d: snapshot.lookup(ROOT, f"dir{d}".encode()).ino for d in range(3)}
    expected = {key: expected_entry(snapshot, key) for key in KEYS}
    wrong: list[str] = []

    def reader(offset: int) -> None:
        for i in range(2000):
            key = KEYS[(offset + 7 * i) % len(KEYS)]
            d, name = key.split("/")
            if snapshot.lookup(dirs[int(d[3:])], name.encode()) != expected[key]:
                wrong.append(key)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_each_snapshot_answers_from_its_own_data(snapshot, tmp_path):
    dir0 = snapshot.lookup(ROOT, b"dir0")
    assert snapshot.lookup(dir0.ino, b"file000.jpg") is not None
    build_snapshot([obj(key) for key in KEYS[1:]], tmp_path / "refreshed", previous=snapshot)
    refreshed = Snapshot.open(tmp_path / "refreshed")
    try:
        assert refreshed.lookup(dir0.ino, b"file000.jpg") is None  # removed by the refresh
        assert refreshed.lookup(dir0.ino, b"file001.jpg") == snapshot.lookup(
            dir0.ino, b"file001.jpg"
        )
        assert snapshot.lookup(dir0.ino, b"file000.jpg") is not None  # the old one is immutable
    finally:
        refreshed.close()


def test_a_closed_snapshot_answers_nothing_even_what_it_remembered(snapshot):
    assert snapshot.lookup(ROOT, b"dir0") is not None
    snapshot.close()
    with pytest.raises(SnapshotError, match="is closed"):
        snapshot.lookup(ROOT, b"dir0")
