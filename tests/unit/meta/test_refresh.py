"""Refreshes: inodes stay stable for unchanged paths, changed files and removed entries are
reported for kernel cache invalidation, and an inode number never comes back for another path."""

from __future__ import annotations

import lmdb
import pytest

import cachefs.meta.build as build_module
from cachefs.meta import ROOT, Snapshot, build_snapshot
from cachefs.store.base import ObjectInfo
from tests.unit.meta.checks import assert_snapshot_matches
from tests.unit.meta.model import build_model, dump


def obj(key: str, size: int = 1, etag: str = "e", mtime_ns: int = 1_000) -> ObjectInfo:
    return ObjectInfo(key=key, size=size, etag=etag, mtime_ns=mtime_ns)


@pytest.fixture
def build(tmp_path):
    opened = []

    def _build(name, objects, previous=None):
        result = build_snapshot(objects, tmp_path / name, previous=previous)
        snapshot = Snapshot.open(tmp_path / name)
        opened.append(snapshot)
        return snapshot, result

    yield _build
    for snapshot in opened:
        snapshot.close()


V1 = [
    obj("keep/same.jpg"),
    obj("keep/new-etag.jpg", etag="v1"),
    obj("keep/new-size.jpg", size=10),
    obj("keep/new-mtime.jpg", mtime_ns=1),
    obj("keep/gone.jpg"),
    obj("gone-dir/sub/a.jpg"),
    obj("gone-dir/b.jpg"),
    obj("was-file"),
    obj("was-dir/x"),
]
V2 = [
    obj("added/c.jpg"),
    obj("keep/added.jpg"),
    obj("keep/new-etag.jpg", etag="v2"),
    obj("keep/new-mtime.jpg", mtime_ns=2),
    obj("keep/new-size.jpg", size=11),
    obj("keep/same.jpg"),
    obj("was-dir"),
    obj("was-file/y"),
]


def test_refresh_keeps_inodes_and_reports_what_changed(build) -> None:
    v1, _ = build("v1", V1)
    before = dump(v1)
    v2, result = build("v2", V2, previous=v1)
    after = dump(v2)

    for path in ["", "keep", "keep/same.jpg"]:
        assert after[path].ino == before[path].ino, path
    assert after["keep/new-mtime.jpg"].ino == before["keep/new-mtime.jpg"].ino
    assert after["keep/new-mtime.jpg"].mtime_ns == 2  # attributes are the new ones
    # New paths, paths whose kind changed and files whose bytes changed get inodes no earlier
    # snapshot used (a reader holding the old version open keeps the old inode's pages).
    old_inos = {entry.ino for entry in before.values()}
    new_bytes = ["keep/new-etag.jpg", "keep/new-size.jpg"]
    for path in ["added", "added/c.jpg", "keep/added.jpg", "was-dir", "was-file", "was-file/y"]:
        assert after[path].ino not in old_inos, path
    for path in new_bytes:
        assert after[path].ino not in old_inos, path

    assert result.changed_inos == []
    keep = before["keep"].ino
    assert sorted(result.replaced) == [(keep, b"new-etag.jpg"), (keep, b"new-size.jpg")]
    # Only the top of a removed subtree: dropping gone-dir's dentry drops everything below it.
    assert sorted(result.removed) == sorted(
        [
            (keep, b"gone.jpg"),
            (ROOT, b"gone-dir"),
            (ROOT, b"was-file"),  # now a directory: new inode, the old dentry must go
            (ROOT, b"was-dir"),  # now a file
        ]
    )
    assert not result.overflow
    assert_snapshot_matches(v2, build_model(V2), result)


def test_a_removed_path_that_comes_back_gets_a_new_inode(build) -> None:
    v1, _ = build("v1", [obj("a/x"), obj("b")])
    v2, result = build("v2", [obj("b")], previous=v1)
    assert result.removed == [(ROOT, b"a")]
    v3, _ = build("v3", [obj("a/x"), obj("b")], previous=v2)
    # The kernel may still hold the old inode numbers of a and a/x: they are not reused.
    assert v3.resolve("a").ino != v1.resolve("a").ino
    assert v3.resolve("a/x").ino != v1.resolve("a/x").ino
    assert v3.resolve("b").ino == v1.resolve("b").ino


def test_a_file_with_new_bytes_changes_its_parents_listing(build) -> None:
    """The name now leads to a new inode, which a listing the kernel keeps must show."""
    v1, _ = build("v1", [obj("d/f", etag="old"), obj("d/g")])
    _v2, result = build("v2", [obj("d/f", etag="new"), obj("d/g")], previous=v1)
    assert result.replaced == [(v1.resolve("d").ino, b"f")]
    assert result.listings_changed == [v1.resolve("d").ino]
    assert (result.changed_inos, result.removed) == ([], [])


def test_identical_refresh_reports_nothing(build) -> None:
    objects = [obj(f"d{i % 5}/f{i}", etag=str(i)) for i in range(500)]
    objects.sort(key=lambda info: info.key)
    v1, _ = build("v1", objects)
    v2, result = build("v2", objects, previous=v1)
    assert (result.changed_inos, result.removed, result.replaced) == ([], [], [])
    assert not result.overflow
    assert {p: e.ino for p, e in dump(v1).items()} == {p: e.ino for p, e in dump(v2).items()}


def test_lists_are_capped_and_say_so(build, monkeypatch) -> None:
    monkeypatch.setattr(build_module, "RESULT_CAP", 3)
    v1, _ = build("v1", [obj(f"f{i}", etag="old") for i in range(10)])
    _v2, result = build("v2", [obj(f"f{i}", etag="old") for i in range(5, 10)], previous=v1)
    assert len(result.removed) == 3 and result.overflow  # f0..f4 are gone
    _v3, result = build("v3", [obj(f"f{i}", etag="new") for i in range(10)], previous=v1)
    assert len(result.replaced) == 3 and result.overflow


def test_refresh_with_many_new_inodes_across_transactions(build, monkeypatch, tmp_path) -> None:
    """New inodes are staged and moved after the build; with tiny transactions that move
    spans many of them."""
    monkeypatch.setattr(build_module, "_BATCH_ENTRIES", 4)
    v1_objects = [obj(f"d/{i:03d}") for i in range(0, 200, 2)]
    v2_objects = [obj(f"d/{i:03d}") for i in range(200)] + [obj("e/new/")]
    v1, _ = build("v1", v1_objects)
    v2, result = build("v2", v2_objects, previous=v1)
    assert_snapshot_matches(v2, build_model(v2_objects), result)
    for i in range(0, 200, 2):
        assert v2.resolve(f"d/{i:03d}").ino == v1.resolve(f"d/{i:03d}").ino
    # The staging database is gone: the snapshot holds exactly its three databases.
    v2.close()  # py-lmdb allows one handle per environment and process
    env = lmdb.open(str(tmp_path / "v2"), readonly=True, lock=False, create=False)
    with env.begin() as txn:
        assert sorted(key for key, _ in txn.cursor()) == [b"dirents", b"inodes", b"meta"]
    env.close()
