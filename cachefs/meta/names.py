"""Which object keys can become paths in the mount, and why the others cannot.

An object key is untrusted text from a bucket listing. It becomes a path only if every
component is a name a POSIX filesystem can hold and no key can reach outside the dataset root.
Each rejection has one short reason; the snapshot counts them so users can see what was left out.
"""

from __future__ import annotations

import stat
from typing import NamedTuple

# Skip reasons, in the order they are checked (a key with several problems gets the first).
UNDECODABLE = "undecodable"  # not valid Unicode (e.g. lone surrogates from surrogateescape)
NUL = "nul"  # a NUL character anywhere: C strings end there
PATH_TOO_LONG = "path-too-long"  # more than PATH_MAX (4096) bytes of UTF-8
EMPTY_SEGMENT = "empty-segment"  # "a//b", "/a", "" — a component with no name
DOT_SEGMENT = "dot-segment"  # "." or ".." would alias or escape a directory
TOO_LONG = "too-long"  # one component over NAME_MAX (255) bytes of UTF-8
CONFLICT = "conflict"  # decided by the builder: a file whose path is also a directory (or a
#                        second object with the same key)
# Entries of a local directory that are not regular files or directories (the listing gives
# their type, see ObjectInfo.mode): never served, counted like the names above.
SYMLINK = "symlink"  # a symlink that does not lead to a regular file inside the directory
FIFO = "fifo"
SOCKET = "socket"
DEVICE = "device"  # character or block device
SPECIAL = "special"  # any other type a filesystem may have
_REASON_BY_TYPE = {
    stat.S_IFLNK: SYMLINK,
    stat.S_IFIFO: FIFO,
    stat.S_IFSOCK: SOCKET,
    stat.S_IFCHR: DEVICE,
    stat.S_IFBLK: DEVICE,
}

MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# A str of this many code points or fewer is at most 4 * 63 = 252 bytes of UTF-8, so its
# byte length need not be computed.
_SHORT_NAME_CHARS = MAX_NAME_BYTES // 4


class SplitKey(NamedTuple):
    """A key taken apart: ``reason`` is None for a usable key."""

    reason: str | None
    parts: list[str]  # path components; for a directory marker, the directory's components
    raw: bytes  # the whole key as UTF-8 (b"" when undecodable)
    is_marker: bool  # key ended in "/": it names a directory, not a file


def split_key(key: str) -> SplitKey:
    """Validate ``key`` and split it into components in one pass (used for every listed key)."""
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        return SplitKey(UNDECODABLE, [], b"", False)
    if "\0" in key:
        return SplitKey(NUL, [], raw, False)
    if len(raw) > MAX_PATH_BYTES:
        return SplitKey(PATH_TOO_LONG, [], raw, False)
    is_marker = key.endswith("/")
    parts = (key[:-1] if is_marker else key).split("/")
    if "" in parts:
        return SplitKey(EMPTY_SEGMENT, [], raw, is_marker)
    if "." in parts or ".." in parts:
        return SplitKey(DOT_SEGMENT, [], raw, is_marker)
    if len(raw) > MAX_NAME_BYTES:  # else no component can be too long
        for part in parts:
            if len(part) > _SHORT_NAME_CHARS and len(part.encode("utf-8")) > MAX_NAME_BYTES:
                return SplitKey(TOO_LONG, [], raw, is_marker)
    return SplitKey(None, parts, raw, is_marker)


def validate_key(key: str) -> str | None:
    """None if ``key`` is a valid POSIX path for the mount, else the skip reason.

    A single trailing "/" is allowed: such a key is a directory marker ("a/b/" names the
    directory a/b). The reasons are the module constants above, except "conflict", which
    depends on the other keys and is decided by the snapshot builder.
    """
    return split_key(key).reason


def unservable_reason(mode: int) -> str | None:
    """The skip reason of a listed entry whose file type (``mode``: a local entry's st_mode) is
    neither a regular file nor a directory; None for those two."""
    file_type = stat.S_IFMT(mode)
    if file_type in (stat.S_IFREG, stat.S_IFDIR):
        return None
    return _REASON_BY_TYPE.get(file_type, SPECIAL)
