"""A straightforward in-memory model of what a snapshot must contain, and a full dump of a
snapshot through its public API, for the tests to compare."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from cachefs.meta import ROOT, Entry, Owner, Snapshot
from cachefs.store.base import ObjectInfo


def model_reason(key: str) -> str | None:
    """The skip reason, written out plainly (independently of cachefs.meta.names)."""
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return "undecodable"
    if "\0" in key:
        return "nul"
    if len(raw) > 4096:
        return "path-too-long"
    body = key[:-1] if key.endswith("/") else key
    segments = body.split("/")
    if "" in segments:
        return "empty-segment"
    if "." in segments or ".." in segments:
        return "dot-segment"
    if any(len(s.encode("utf-8")) > 255 for s in segments):
        return "too-long"
    return None


@dataclass
class Model:
    files: dict[str, ObjectInfo] = field(default_factory=dict)  # path -> the object served
    dirs: set[str] = field(default_factory=set)  # directory paths ("" is the root)
    skipped: Counter[str] = field(default_factory=Counter)
    owners: dict[str, Owner] = field(default_factory=dict)  # path -> what its source recorded

    def owner(self, path: str) -> Owner | None:
        return self.owners.get(path)

    def kind(self, path: str) -> str | None:
        if path in self.dirs:
            return "dir"
        return "file" if path in self.files else None

    def children(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        return [
            p
            for p in (*self.dirs, *self.files)
            if p and p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]

    def dir_mtime(self, path: str, snapshot_ns: int) -> int:
        """Max of the direct children's mtimes; an empty directory has the snapshot time."""
        times = [
            self.files[c].mtime_ns if c in self.files else self.dir_mtime(c, snapshot_ns)
            for c in self.children(path)
        ]
        return max(times, default=snapshot_ns)


def owner_of(info: ObjectInfo) -> Owner | None:
    return None if info.mode is None else Owner(info.mode & 0o7777, info.uid, info.gid)


def build_model(objects: Iterable[ObjectInfo]) -> Model:
    """What a listing must become. Owners: a file's come with it; a directory's with its marker
    (the last one, if the listing repeats it), the root's with the marker ""."""
    model = Model(dirs={""})
    first_seen: dict[str, ObjectInfo] = {}
    marker_owners: dict[str, Owner | None] = {}
    for info in objects:
        key = info.key
        if key == "" and info.size == 0:
            marker_owners[""] = owner_of(info)
            continue
        reason = model_reason(key)
        if reason is None and key.endswith("/") and info.size:
            reason = "empty-segment"
        if reason:
            model.skipped[reason] += 1
            continue
        path = key[:-1] if key.endswith("/") else key
        parts = path.split("/")
        depth = len(parts) if key.endswith("/") else len(parts) - 1
        for i in range(1, depth + 1):
            model.dirs.add("/".join(parts[:i]))
        if key.endswith("/"):
            marker_owners[path] = owner_of(info)
            continue
        if path in first_seen:
            model.skipped["conflict"] += 1  # same key twice: the first one wins
        else:
            first_seen[path] = info
    for path, info in first_seen.items():
        if path in model.dirs:
            model.skipped["conflict"] += 1  # the directory wins
        else:
            model.files[path] = info
            if info.mode is not None:
                model.owners[path] = owner_of(info)
    for path, owner in marker_owners.items():
        if owner is not None and path in model.dirs:
            model.owners[path] = owner
    return model


def dump(snapshot: Snapshot) -> dict[str, Entry]:
    """Every entry reachable from the root via readdir, by path ("" is the root)."""
    root = snapshot.getattr(ROOT)
    assert root is not None
    entries = {"": root}
    pending = [("", root)]
    while pending:
        path, directory = pending.pop()
        for entry in snapshot.readdir(directory.ino):
            child = entry.name.decode("utf-8")
            child_path = f"{path}/{child}" if path else child
            assert child_path not in entries, f"{child_path!r} listed twice"
            entries[child_path] = entry
            if entry.is_dir:
                pending.append((child_path, entry))
    return entries
