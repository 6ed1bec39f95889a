"""The on-disk layout of a snapshot: LMDB sub-databases, key encodings and packed records.

One LMDB environment (a directory holding ``data.mdb``) per snapshot, with three named DBs:

``inodes``   ino (8 bytes, big-endian, so keys sort numerically) -> packed record
``dirents``  parent ino (8 bytes, big-endian) + child name (UTF-8) -> child ino (8 bytes)
             All children of a directory are contiguous and sorted by name bytes.
``meta``     format version, next free inode, stats (JSON), and the "complete" marker.

A record is a fixed header followed by the etag and a tail::

    kind u8 | etag_len u16 | nlink u32 | size u64 | mtime_ns i64 | parent u64 | etag | tail

where the tail is the object key for a file (its name is the part after the last "/") and the
name for a directory. Packing with ``struct`` keeps a record ~100 bytes and decoding ~1 µs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

ROOT = 1  # inode of the dataset's root directory (ROOT's parent is ROOT)
MAX_INO = 1 << 48  # local inodes stay below this; the FS layer may use the bits above
FORMAT_VERSION = b"1"

INODES_DB = b"inodes"
DIRENTS_DB = b"dirents"
META_DB = b"meta"
DB_COUNT = 3

META_FORMAT = b"format"
META_NEXT_INO = b"next_ino"
META_STATS = b"stats"
META_COMPLETE = b"complete"

KIND_FILE = 0
KIND_DIR = 1

INO = struct.Struct(">Q")
HEADER = struct.Struct("<BHIQqQ")
_ETAG_ENCODING = ("utf-8", "surrogatepass")  # etags are opaque: keep any str round-trippable


@dataclass(frozen=True, slots=True)
class Entry:
    ino: int  # local inode, stable across refreshes for the same path
    parent: int  # parent's ino (ROOT's parent is ROOT)
    name: bytes  # one path component, valid UTF-8 (b"" for ROOT)
    is_dir: bool
    size: int  # files: object size; dirs: 0
    mtime_ns: int  # files: object mtime; dirs: max of direct children's mtime, or snapshot time
    etag: str  # files only ("" for dirs)
    key: str  # files: the object key relative to the dataset prefix; dirs: ""
    nlink: int  # files 1; dirs 2 + number of subdirectories


def encode_etag(etag: str) -> bytes:
    return etag.encode(*_ETAG_ENCODING)


def pack_file(size: int, mtime_ns: int, parent: int, etag: bytes, key: bytes) -> bytes:
    return HEADER.pack(KIND_FILE, len(etag), 1, size, mtime_ns, parent) + etag + key


def pack_dir(nlink: int, mtime_ns: int, parent: int, name: bytes) -> bytes:
    return HEADER.pack(KIND_DIR, 0, nlink, 0, mtime_ns, parent) + name


def unpack_entry(ino: int, record: bytes) -> Entry:
    kind, etag_len, nlink, size, mtime_ns, parent = HEADER.unpack_from(record)
    tail_at = HEADER.size + etag_len
    tail = record[tail_at:]
    if kind == KIND_DIR:
        return Entry(ino, parent, tail, True, 0, mtime_ns, "", "", nlink)
    etag = record[HEADER.size : tail_at].decode(*_ETAG_ENCODING)
    name = tail[tail.rfind(b"/") + 1 :]
    return Entry(ino, parent, name, False, size, mtime_ns, etag, tail.decode("utf-8"), nlink)


def file_version(record: bytes) -> tuple[int, int, bytes]:
    """(kind, size, etag bytes) of a record, without building an Entry (the refresh hot path)."""
    kind, etag_len, _nlink, size, _mtime, _parent = HEADER.unpack_from(record)
    return kind, size, record[HEADER.size : HEADER.size + etag_len]
