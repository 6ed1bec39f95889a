"""The namespace snapshot: a dataset's listing frozen into LMDB with stable inode numbers.

The FUSE core serves every lookup, getattr and readdir from a :class:`Snapshot`; a refresh
builds a new one with :func:`build_snapshot` (passing the old one as ``previous``) and swaps it
in. Keys that cannot be POSIX paths are skipped, counted and sampled (:func:`validate_key`), as
are a local directory's symlinks, FIFOs, sockets and devices; a local directory's modes and
owners are kept per entry (:class:`Owner`).
"""

from cachefs.meta.build import BuildResult, build_snapshot
from cachefs.meta.names import validate_key
from cachefs.meta.records import ROOT, Entry, Owner
from cachefs.meta.snapshot import Snapshot, SnapshotError, SnapshotStats

__all__ = [
    "ROOT",
    "BuildResult",
    "Entry",
    "Owner",
    "Snapshot",
    "SnapshotError",
    "SnapshotStats",
    "build_snapshot",
    "validate_key",
]
