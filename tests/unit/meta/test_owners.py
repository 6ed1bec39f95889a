"""Modes and owners of a local listing, directory markers, the entries a local directory lists
but cannot serve, and snapshots written before owners were recorded (format 1). Real LMDB."""

from __future__ import annotations

import gzip
import os
import shutil
import stat

import pytest

from cachefs.meta import ROOT, Owner, Snapshot, build_snapshot
from cachefs.store.base import ObjectInfo

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


def obj(key: str, size: int = 0, mode: int | None = None, uid: int = 0, gid: int = 0):
    if mode is None:  # an object store's object: no owner
        return ObjectInfo(key=key, size=size, etag=f"e-{key}", mtime_ns=1)
    return ObjectInfo(key, size, f"e-{key}", 1, mode, uid, gid)


@pytest.fixture
def build(tmp_path):
    opened: list[Snapshot] = []
    counter = iter(range(1_000_000))

    def _build(objects, previous=None):
        dest = tmp_path / f"snap-{next(counter)}"
        result = build_snapshot(objects, dest, previous=previous)
        snapshot = Snapshot.open(dest)
        opened.append(snapshot)
        return snapshot, result

    yield _build
    for snapshot in opened:
        snapshot.close()


def test_a_local_listing_s_modes_and_owners_are_kept_per_entry(build) -> None:
    snapshot, _ = build(
        [
            obj("", mode=stat.S_IFDIR | 0o750, uid=0, gid=42),
            obj("private/", mode=stat.S_IFDIR | 0o700, uid=1000, gid=1000),
            obj("private/key.pem", 5, mode=stat.S_IFREG | 0o600, uid=1000, gid=1000),
            obj("public.txt", 3, mode=stat.S_IFREG | 0o4755, uid=0, gid=0),
        ]
    )

    assert snapshot.getattr(ROOT).owner == Owner(0o750, 0, 42)
    assert snapshot.resolve("private").owner == Owner(0o700, 1000, 1000)
    assert snapshot.resolve("private/key.pem").owner == Owner(0o600, 1000, 1000)
    # Recorded as the source has it; the mount drops what it must not show (cachefs/fs/core.py).
    assert snapshot.resolve("public.txt").owner == Owner(0o4755, 0, 0)


def test_an_object_store_s_entries_record_no_owner(build) -> None:
    snapshot, _ = build([obj("a/b.bin", 3), obj("c/", 0)])

    assert [snapshot.resolve(p).owner for p in ["", "a", "a/b.bin", "c"]] == [None] * 4


def test_directory_markers_are_empty_directories_never_files(build) -> None:
    # DLIO's layout: train/ with files, valid/ only a marker (an empty directory in the bucket).
    snapshot, result = build([obj("train/", 0), obj("train/a.npz", 4), obj("valid/", 0)])

    valid = snapshot.resolve("valid")
    assert valid.is_dir and list(snapshot.readdir(valid.ino)) == []
    assert [entry.name for entry in snapshot.readdir(ROOT)] == [b"train", b"valid"]
    assert (result.stats.files, result.stats.dirs, result.stats.skipped) == (1, 2, {})


@pytest.mark.parametrize("order", ["file first", "marker first"])
def test_a_marker_with_a_file_s_path_follows_the_conflict_rule(build, order) -> None:
    objects = [obj("x", 7), obj("x/", 0)]
    if order == "marker first":
        objects.reverse()  # unsorted input: the file arrives after the directory exists

    snapshot, result = build(objects)

    assert snapshot.resolve("x").is_dir  # the directory wins, as for "x" and "x/y"
    assert result.stats.skipped == {"conflict": 1}
    assert result.stats.skipped_samples == ["'x'"]
    assert (result.stats.files, result.stats.bytes) == (0, 0)


def test_symlinks_fifos_sockets_and_devices_are_skipped_counted_with_examples(build) -> None:
    snapshot, result = build(
        [
            obj("data/ok.bin", 2, mode=stat.S_IFREG | 0o644),
            obj("data/link-out", mode=stat.S_IFLNK | 0o777),
            obj("data/pipe", mode=stat.S_IFIFO | 0o644),
            obj("data/sock", mode=stat.S_IFSOCK | 0o755),
            obj("data/tty", mode=stat.S_IFCHR | 0o620),
            obj("data/disk", mode=stat.S_IFBLK | 0o660),
        ]
    )

    assert [e.name for e in snapshot.readdir(snapshot.resolve("data").ino)] == [b"ok.bin"]
    assert result.stats.skipped == {"device": 2, "fifo": 1, "socket": 1, "symlink": 1}
    assert sorted(result.stats.skipped_samples) == sorted(
        ["'data/link-out'", "'data/pipe'", "'data/sock'", "'data/tty'", "'data/disk'"]
    )


def test_a_refresh_reports_a_changed_mode_or_owner_as_a_change(build) -> None:
    def listing(dir_mode: int, file_uid: int) -> list[ObjectInfo]:
        return [
            obj("", mode=stat.S_IFDIR | 0o755),
            obj("d/", mode=stat.S_IFDIR | dir_mode),
            obj("d/f", 3, mode=stat.S_IFREG | 0o644, uid=file_uid),
            obj("d/same", 3, mode=stat.S_IFREG | 0o644),
        ]

    old, _ = build(listing(0o755, 0))
    unchanged, same = build(listing(0o755, 0), previous=old)
    assert same.changed_inos == []
    _new, changed = build(listing(0o700, 1000), previous=unchanged)

    assert sorted(changed.changed_inos) == sorted([old.resolve("d").ino, old.resolve("d/f").ino])


# The fixture was written by cachefs's builder before owners were recorded (commit 486e6f2),
# from: "public.bin" (6 bytes), "secret.bin" (6), "sub/" marker, "sub/inner.bin" (5),
# "empty/" marker and the skipped "bad//key".
def unpack_format1_fixture(tmp_path) -> str:
    dest = tmp_path / "format1"
    dest.mkdir()
    packed_path = os.path.join(DATA_DIR, "format1-snapshot.mdb.gz")
    with gzip.open(packed_path) as packed, open(dest / "data.mdb", "wb") as unpacked:
        shutil.copyfileobj(packed, unpacked)
    return str(dest)


def test_a_format_1_snapshot_opens_and_serves_with_no_recorded_owners(tmp_path) -> None:
    snapshot = Snapshot.open(unpack_format1_fixture(tmp_path))
    try:
        assert not snapshot.records_owners
        secret = snapshot.resolve("secret.bin")
        assert (secret.size, secret.etag, secret.key, secret.owner) == (
            6,
            "e-secret",
            "secret.bin",
            None,
        )
        assert snapshot.resolve("sub/inner.bin").size == 5
        assert snapshot.resolve("empty").is_dir
        assert [e.name for e in snapshot.readdir(ROOT)] == [
            b"empty",
            b"public.bin",
            b"secret.bin",
            b"sub",
        ]
        assert snapshot.stats.skipped == {"empty-segment": 1}
        assert sorted(e.key for e in snapshot.iter_files()) == [
            "public.bin",
            "secret.bin",
            "sub/inner.bin",
        ]
    finally:
        snapshot.close()


def test_a_refresh_of_a_format_1_snapshot_keeps_inodes_and_adds_owners(build, tmp_path) -> None:
    old = Snapshot.open(unpack_format1_fixture(tmp_path))
    try:
        listing = [
            obj("", mode=stat.S_IFDIR | 0o755),
            obj("empty/", mode=stat.S_IFDIR | 0o755),
            ObjectInfo("public.bin", 6, "e-public", 1, stat.S_IFREG | 0o644, 0, 0),
            ObjectInfo("secret.bin", 6, "e-secret", 1, stat.S_IFREG | 0o600, 0, 0),
            obj("sub/", mode=stat.S_IFDIR | 0o755),
            ObjectInfo("sub/inner.bin", 5, "e-inner", 1, stat.S_IFREG | 0o644, 0, 0),
        ]
        new, result = build(listing, previous=old)

        assert new.records_owners
        for path in ["", "empty", "public.bin", "secret.bin", "sub", "sub/inner.bin"]:
            assert new.resolve(path).ino == old.resolve(path).ino, path
        assert new.resolve("secret.bin").owner == Owner(0o600, 0, 0)
        # Every entry gained an owner: all of them are changes the kernel must hear of.
        assert len(result.changed_inos) == 6 and result.removed == []
    finally:
        old.close()


def _walk_pairs(snapshot: Snapshot):
    """(Entry from readdir, fields from readdir_fields) of every child of every directory,
    read page by page (after=) as the kernel does."""
    pending = [ROOT]
    while pending:
        directory = pending.pop()
        entries = list(snapshot.readdir(directory))
        fields = list(snapshot.readdir_fields(directory))
        assert [f[1] for f in fields] == [e.ino for e in entries]
        if entries:  # resuming after the first child gives the rest, in the same order
            assert list(snapshot.readdir_fields(directory, entries[0].ino)) == fields[1:]
        for entry, field in zip(entries, fields, strict=True):
            yield entry, field
            if entry.is_dir:
                pending.append(entry.ino)


def _expected_fields(entry):
    owner = entry.owner
    return (
        entry.name, entry.ino, entry.is_dir, entry.size, entry.mtime_ns, entry.nlink,
        None if owner is None else owner.mode,
        0 if owner is None else owner.uid,
        0 if owner is None else owner.gid,
    )  # fmt: skip


def test_listing_fields_say_what_full_entries_say(build, tmp_path) -> None:
    """readdir_fields (what a directory listing decodes, no Entry built) against readdir's
    entries: with and without recorded owners, and in a format-1 snapshot."""
    snapshot, _ = build(
        [
            obj("a.bin", 7),
            obj("d/", mode=stat.S_IFDIR | 0o750, uid=5, gid=6),
            obj("d/x.bin", 3, mode=stat.S_IFREG | 0o640, uid=5, gid=6),
            obj("d/y.bin", 0),
            obj("e/f/g.bin", 11),
        ]
    )
    pairs = list(_walk_pairs(snapshot))
    assert len(pairs) == 7
    for entry, field in pairs:
        assert field == _expected_fields(entry)
    old = Snapshot.open(unpack_format1_fixture(tmp_path))
    try:
        pairs = list(_walk_pairs(old))
        assert len(pairs) == 5
        for entry, field in pairs:
            assert field == _expected_fields(entry)
    finally:
        old.close()
