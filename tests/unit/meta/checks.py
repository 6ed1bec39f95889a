"""Assertions shared by the meta tests: a built snapshot against the plain model."""

from __future__ import annotations

from cachefs.meta import ROOT, BuildResult, Entry, Snapshot
from tests.unit.meta.model import Model, dump

# Directory mtimes that come from the snapshot time are compared with stats.built_at, a float:
# it rounds the nanosecond clock by a few hundred ns.
SNAPSHOT_TIME_SLACK_NS = 1_000
LOCAL_INO_LIMIT = 1 << 48  # the contract: local inodes stay below 2**48


def assert_snapshot_matches(snapshot: Snapshot, model: Model, result: BuildResult) -> None:
    stats = result.stats
    snapshot_ns = round(stats.built_at * 1e9)
    entries = dump(snapshot)
    assert set(entries) == model.dirs | set(model.files)
    inos = [entry.ino for entry in entries.values()]
    assert len(set(inos)) == len(inos), "two paths share an inode"

    root = entries[""]
    assert (root.ino, root.parent, root.name, root.is_dir) == (ROOT, ROOT, b"", True)
    assert snapshot.resolve("") == root

    # The batch resolve answers as resolve does, for every path and for paths that are not
    # there: under a file, empty components, a trailing slash, a missing name.
    questions = list(entries)
    questions += [f"{path}/x" for path in entries] + [f"{path}/" for path in entries]
    questions += ["nope", "a//b", "/a", "nope/deeper/still"]
    assert snapshot.resolve_many(questions) == [snapshot.resolve(path) for path in questions]

    for path, entry in entries.items():
        assert 0 < entry.ino < LOCAL_INO_LIMIT
        assert entry.owner == model.owner(path), f"{path!r} has the wrong owner"
        assert snapshot.getattr(entry.ino) == entry
        assert snapshot.resolve(path) == entry
        if path:
            assert_valid_name(entry.name)
            parent_path, _, name = path.rpartition("/")
            assert entry.name == name.encode("utf-8")
            assert entry.parent == entries[parent_path].ino
            assert snapshot.lookup(entry.parent, entry.name) == entry
        if entry.is_dir:
            assert_directory(snapshot, model, path, entry, snapshot_ns)
        else:
            info = model.files[path]
            assert (entry.size, entry.etag, entry.mtime_ns, entry.key, entry.nlink) == (
                info.size,
                info.etag,
                info.mtime_ns,
                path,
                1,
            )

    assert stats.files == len(model.files)
    assert stats.dirs == len(model.dirs) - 1  # the root is not counted
    assert stats.bytes == sum(info.size for info in model.files.values())
    assert stats.skipped == dict(model.skipped)
    assert len(stats.skipped_samples) == min(20, sum(model.skipped.values()))
    assert all(sample.isascii() and sample.isprintable() for sample in stats.skipped_samples)


def assert_valid_name(name: bytes) -> None:
    assert name not in (b"", b".", b"..")
    assert b"/" not in name and b"\0" not in name
    assert len(name) <= 255
    name.decode("utf-8")  # raises if not valid UTF-8


def assert_directory(
    snapshot: Snapshot, model: Model, path: str, entry: Entry, snapshot_ns: int
) -> None:
    children = list(snapshot.readdir(entry.ino))
    names = [child.name for child in children]
    assert names == sorted(names), "readdir is not sorted by name bytes"
    assert entry.nlink == 2 + sum(child.is_dir for child in children)
    assert (entry.size, entry.etag, entry.key) == (0, "", "")
    expected_mtime = model.dir_mtime(path, snapshot_ns)
    if expected_mtime == snapshot_ns:
        assert abs(entry.mtime_ns - snapshot_ns) <= SNAPSHOT_TIME_SLACK_NS
    else:
        assert entry.mtime_ns == expected_mtime
    for position, child in enumerate(children):
        assert list(snapshot.readdir(entry.ino, after=child.ino)) == children[position + 1 :]
