"""Property tests: random listings, hostile keys included, built into real LMDB snapshots and
compared with the plain model in tests/unit/meta/model.py (paths, attributes, names, readdir order
and resumption from every position, stats), sorted and unsorted, and refreshes against it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import tempfile
from collections.abc import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachefs.meta.build as build_module
from cachefs.meta import BuildResult, Entry, Snapshot, build_snapshot
from cachefs.store.base import ObjectInfo
from tests.unit.meta.checks import assert_snapshot_matches
from tests.unit.meta.model import Model, build_model, dump

# Few distinct names, so that keys collide: files vs directories, duplicates, siblings whose
# key order differs from their name order ("a" < "a-1" < "a.b" < "a0" by name, but "a-1", "a.b"
# sort before "a/..." by key).
VALID_COMPONENTS = ["a", "b", "a.b", "a-1", "a0", "é", "日本", " ", "c\nd", "x" * 255]
INVALID_COMPONENTS = [
    "y" * 256,  # one byte over NAME_MAX
    "é" * 128,  # 256 bytes in 128 characters
    ".",
    "..",
    "",
    "n\0ul",
    "\udcff",  # what os.fsdecode makes of an undecodable byte
]
# Valid names three times as likely: about half of the three-component keys are valid.
HOSTILE_COMPONENTS = VALID_COMPONENTS * 3 + INVALID_COMPONENTS
TOO_LONG_PATH = "/".join(["p" * 200] * 21)  # 4220 bytes
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def keys(draw: st.DrawFn, components: list[str]) -> str:
    key = "/".join(draw(st.lists(st.sampled_from(components), min_size=1, max_size=4)))
    if draw(st.integers(0, 9)) == 0:
        key = "/" + key
    if draw(st.integers(0, 4)) == 0:
        key += "/"  # a directory marker
    return key


@st.composite
def listings(
    draw: st.DrawFn, components: list[str], *, extra_keys: tuple[str, ...] = ()
) -> list[ObjectInfo]:
    """Up to 60 objects (drawing the length first keeps long listings as likely as short ones).
    Now and then a key from ``extra_keys`` or the empty key (the prefix's own marker)."""
    rare_key = st.sampled_from([*extra_keys, ""])
    key = st.integers(0, 19).flatmap(lambda n: rare_key if n == 0 else keys(components))
    objects = st.builds(
        with_owner,
        st.builds(
            ObjectInfo,
            key=key,
            size=st.integers(0, 3),  # markers with size 0 and with content
            etag=st.sampled_from(["e1", "e2", ""]),
            mtime_ns=st.integers(0, 10**12),
        ),
        OWNERS,
    )
    count = draw(st.integers(0, 60))
    return draw(st.lists(objects, min_size=count, max_size=count))


# What a local directory's listing records: none (an object store), or a mode and owner.
OWNERS = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from([0o644, 0o600, 0o755, 0o000, 0o4755, 0o1777]),
        st.sampled_from([0, 1000, 65534, (1 << 32) - 2]),
        st.sampled_from([0, 100, (1 << 32) - 2]),
    ),
)


def with_owner(info: ObjectInfo, owner: tuple[int, int, int] | None) -> ObjectInfo:
    """``info`` with a local listing's mode (of the file type its key says), uid and gid."""
    if owner is None:
        return info
    perm, uid, gid = owner
    file_type = stat.S_IFDIR if not info.key or info.key.endswith("/") else stat.S_IFREG
    return dataclasses.replace(info, mode=file_type | perm, uid=uid, gid=gid)


def in_key_order(objects: list[ObjectInfo]) -> list[ObjectInfo]:
    return sorted(objects, key=lambda info: info.key.encode("utf-8", "surrogatepass"))


@contextlib.contextmanager
def snapshot_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="meta-test-") as parent:
        yield os.path.join(parent, "snap")


@contextlib.contextmanager
def small_batches() -> Iterator[None]:
    """Commit every few entries so that small listings cross transaction boundaries too."""
    saved = build_module._BATCH_ENTRIES
    build_module._BATCH_ENTRIES = 3
    try:
        yield
    finally:
        build_module._BATCH_ENTRIES = saved


@SETTINGS
@given(
    objects=listings(HOSTILE_COMPONENTS, extra_keys=(TOO_LONG_PATH,)),
    sort=st.booleans(),
    batches=st.booleans(),
)
def test_snapshot_matches_model(objects: list[ObjectInfo], sort: bool, batches: bool) -> None:
    if sort:
        objects = in_key_order(objects)
    with snapshot_dir() as dest, small_batches() if batches else contextlib.nullcontext():
        result = build_snapshot(objects, dest)
        snapshot = Snapshot.open(dest)
        try:
            assert result.changed_inos == [] and result.removed == [] and not result.overflow
            assert_snapshot_matches(snapshot, build_model(objects), result)
        finally:
            snapshot.close()


REFRESH_COMPONENTS = ["a", "b", "a.b", "c"]


@st.composite
def refreshed(draw: st.DrawFn, old_objects: list[ObjectInfo]) -> list[ObjectInfo]:
    """The next listing: each old object kept, dropped or given a new etag, size or owner,
    plus new objects."""
    new_objects = []
    for info in old_objects:
        change = draw(st.sampled_from(["keep", "keep", "drop", "etag", "size", "mtime", "owner"]))
        if change == "drop":
            continue
        if change == "etag":
            info = dataclasses.replace(info, etag=info.etag + "'")
        elif change == "size":
            info = dataclasses.replace(info, size=info.size + 1)
        elif change == "mtime":
            info = dataclasses.replace(info, mtime_ns=info.mtime_ns + 1)  # not a change
        elif change == "owner":
            info = with_owner(dataclasses.replace(info, mode=None), draw(OWNERS))
        new_objects.append(info)
    return new_objects + draw(listings(REFRESH_COMPONENTS))


@SETTINGS
@given(data=st.data(), sort=st.booleans(), batches=st.booleans())
def test_refresh_keeps_inodes_and_reports_changes(
    data: st.DataObject, sort: bool, batches: bool
) -> None:
    old_objects = data.draw(listings(REFRESH_COMPONENTS), label="old")
    new_objects = data.draw(refreshed(old_objects), label="new")
    if sort:
        old_objects, new_objects = in_key_order(old_objects), in_key_order(new_objects)
    else:
        new_objects = data.draw(st.permutations(new_objects), label="new order")
    old_model, new_model = build_model(old_objects), build_model(new_objects)
    with (
        snapshot_dir() as old_dest,
        snapshot_dir() as new_dest,
        small_batches() if batches else contextlib.nullcontext(),
    ):
        build_snapshot(old_objects, old_dest)
        old = Snapshot.open(old_dest)
        result = build_snapshot(new_objects, new_dest, previous=old)
        new = Snapshot.open(new_dest)
        try:
            assert_snapshot_matches(new, new_model, result)
            old_entries, new_entries = dump(old), dump(new)
            assert_refresh(old_model, new_model, old_entries, new_entries, result)
        finally:
            old.close()
            new.close()


def assert_refresh(
    old_model: Model,
    new_model: Model,
    old_entries: dict[str, Entry],
    new_entries: dict[str, Entry],
    result: BuildResult,
) -> None:
    old_inos = {entry.ino for entry in old_entries.values()}
    expected_changed = set()

    def new_bytes(path: str) -> bool:
        """A file in both snapshots whose bytes (size or etag) changed: it gets a new inode."""
        if old_model.kind(path) != "file" or new_model.kind(path) != "file":
            return False
        old_info, new_info = old_model.files[path], new_model.files[path]
        return (old_info.size, old_info.etag) != (new_info.size, new_info.etag)

    for path, entry in new_entries.items():
        kind = new_model.kind(path)
        if new_bytes(path):
            assert entry.ino not in old_inos, f"{path!r} has new bytes but an old inode"
        elif old_model.kind(path) == kind:
            assert entry.ino == old_entries[path].ino, f"{path!r} changed inode"
            if old_model.owner(path) != new_model.owner(path):  # the kernel caches attributes
                expected_changed.add(entry.ino)
        else:
            assert entry.ino not in old_inos, f"new path {path!r} reuses an old inode"
    assert sorted(result.changed_inos) == sorted(expected_changed)

    expected_replaced = {
        (entry.parent, entry.name) for path, entry in old_entries.items() if new_bytes(path)
    }
    assert sorted(result.replaced) == sorted(expected_replaced)

    # Removed: old paths that are gone or changed kind, listed at the topmost level only
    # (their parent directory still exists in the new snapshot).
    expected_removed = set()
    for path, entry in old_entries.items():
        if not path or new_model.kind(path) == old_model.kind(path):
            continue
        parent_path = path.rpartition("/")[0]
        if new_model.kind(parent_path) == "dir":
            expected_removed.add((entry.parent, entry.name))
    assert len(result.removed) == len(set(result.removed))
    assert set(result.removed) == expected_removed
    assert not result.overflow
