"""The on-disk layout of a snapshot: LMDB sub-databases, key encodings and packed records.

One LMDB environment (a directory holding ``data.mdb``) per snapshot, with three named DBs:

``inodes``   ino (8 bytes, big-endian, so keys sort numerically) -> packed record
``dirents``  parent ino (8 bytes, big-endian) + child name (UTF-8) -> child ino (8 bytes)
             All children of a directory are contiguous and sorted by name bytes.
``meta``     format version, next free inode, stats (JSON), and the "complete" marker.

A record is a fixed header followed by the etag and a tail::

    kind u8 | etag_len u16 | nlink u32 | size u64 | mtime_ns i64 | parent u64
            | mode u16 | uid u32 | gid u32 | etag | tail

where the tail is the object key for a file (its name is the part after the last "/") and the
name for a directory. ``mode`` holds the permission bits the source recorded (a ``file://``
directory: ``st_mode & 0o7777``, with its uid and gid); object stores record none, written as
``NO_MODE`` (the mount then shows its own defaults, see cachefs/fs/permissions.py). Packing with
``struct`` keeps a record ~100 bytes and decoding ~1 µs.

Format history: "1" had no mode, uid or gid (the 10 bytes after ``parent``). Format-1
snapshots still open: :func:`upgrade_v1_record` turns each record into the current layout as it
is read, with ``NO_MODE`` — exactly what an object store's entry records today.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import MemberDescriptorType
from typing import NamedTuple

ROOT = 1  # inode of the dataset's root directory (ROOT's parent is ROOT)
MAX_INO = 1 << 48  # local inodes stay below this; the FS layer may use the bits above
FORMAT_VERSION = b"2"
FORMAT_V1 = b"1"  # before mode, uid and gid were recorded

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
HEADER = struct.Struct("<BHIQqQHII")
_V1_HEADER_SIZE = struct.calcsize("<BHIQqQ")
NO_MODE = 0xFFFF  # the source recorded no mode or owner (permission bits never exceed 0o7777)
_NOT_RECORDED = (NO_MODE, 0, 0)  # mode, uid, gid: HEADER's last fields
_NO_PERMISSIONS = struct.pack("<HII", *_NOT_RECORDED)
_ETAG_ENCODING = ("utf-8", "surrogatepass")  # etags are opaque: keep any str round-trippable


class Owner(NamedTuple):
    """What a source recorded about who may read an entry (a tuple: built on every decode)."""

    mode: int  # permission bits, st_mode & 0o7777
    uid: int
    gid: int


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
    # What the source recorded about who may read it; None where it records nothing (object
    # stores, directories only implied by keys): the mount's own defaults apply.
    owner: Owner | None = None


def encode_etag(etag: str) -> bytes:
    return etag.encode(*_ETAG_ENCODING)


def pack_file(
    size: int, mtime_ns: int, parent: int, etag: bytes, key: bytes, owner: Owner | None
) -> bytes:
    permissions = owner or _NOT_RECORDED
    return HEADER.pack(KIND_FILE, len(etag), 1, size, mtime_ns, parent, *permissions) + etag + key


def pack_dir(nlink: int, mtime_ns: int, parent: int, name: bytes, owner: Owner | None) -> bytes:
    return HEADER.pack(KIND_DIR, 0, nlink, 0, mtime_ns, parent, *(owner or _NOT_RECORDED)) + name


def upgrade_v1_record(record: bytes) -> bytes:
    """A format-1 record in the current layout (no recorded mode or owner)."""
    return record[:_V1_HEADER_SIZE] + _NO_PERMISSIONS + record[_V1_HEADER_SIZE:]


#: The formats a snapshot may be in, each with what turns one of its records into the current
#: layout (None: it is the current layout).
RECORD_UPGRADES: dict[bytes, Callable[[bytes], bytes] | None] = {
    FORMAT_VERSION: None,
    FORMAT_V1: upgrade_v1_record,
}


# unpack_entry is the hot path of every getattr, lookup and readdir entry. A frozen dataclass's
# __init__ sets each field through object.__setattr__ (~1.5 µs for ten fields); setting the
# slots directly through their descriptors builds the same Entry in half the time. Every field
# is set below (in both branches): an Entry field added without a line here would be unset.
_new_entry = object.__new__


def _slot_setter(field: str) -> Callable[[Entry, object], None]:
    """The ``__set__`` of Entry's slot ``field`` (the class attribute is the slot's descriptor
    at run time; type checkers see the field's type there, so it is looked up in the class dict)."""
    slot = vars(Entry)[field]
    assert isinstance(slot, MemberDescriptorType), field
    return slot.__set__


_set_ino = _slot_setter("ino")
_set_parent = _slot_setter("parent")
_set_name = _slot_setter("name")
_set_is_dir = _slot_setter("is_dir")
_set_size = _slot_setter("size")
_set_mtime_ns = _slot_setter("mtime_ns")
_set_etag = _slot_setter("etag")
_set_key = _slot_setter("key")
_set_nlink = _slot_setter("nlink")
_set_owner = _slot_setter("owner")


def unpack_entry(ino: int, record: bytes) -> Entry:
    kind, etag_len, nlink, size, mtime_ns, parent, mode, uid, gid = HEADER.unpack_from(record)
    tail_at = HEADER.size + etag_len
    tail = record[tail_at:]
    entry = _new_entry(Entry)
    _set_ino(entry, ino)
    _set_parent(entry, parent)
    _set_mtime_ns(entry, mtime_ns)
    _set_nlink(entry, nlink)
    _set_owner(entry, None if mode == NO_MODE else Owner(mode, uid, gid))
    if kind == KIND_DIR:
        _set_name(entry, tail)
        _set_is_dir(entry, True)
        _set_size(entry, 0)
        _set_etag(entry, "")
        _set_key(entry, "")
    else:
        _set_name(entry, tail[tail.rfind(b"/") + 1 :])
        _set_is_dir(entry, False)
        _set_size(entry, size)
        _set_etag(entry, _decode_etag(record[HEADER.size : tail_at]))
        _set_key(entry, tail.decode())
    return entry


def _decode_etag(etag: bytes) -> str:
    try:
        return etag.decode()  # the usual case, and the fastest call
    except UnicodeDecodeError:
        return etag.decode(*_ETAG_ENCODING)


def file_version(record: bytes) -> tuple[int, int, bytes]:
    """(kind, size, etag bytes) of a record, without building an Entry (the refresh hot path)."""
    kind, etag_len, _nlink, size, _mtime, _parent, _mode, _uid, _gid = HEADER.unpack_from(record)
    return kind, size, record[HEADER.size : HEADER.size + etag_len]


def permissions_of(record: bytes) -> bytes:
    """The packed mode, uid and gid of a record (compared, never decoded, by a refresh)."""
    return record[_V1_HEADER_SIZE : HEADER.size]
