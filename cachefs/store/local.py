"""A local directory as an object store: ``file:///dir``.

Keys are paths relative to the directory, with "/" separators. Names are ``os.fsdecode``-d, so
a name that is not valid UTF-8 reaches the snapshot builder as a surrogate-escaped string (and
is rejected there, with a count), never as something silently re-encoded.

The listing carries each entry's mode, uid and gid (``ObjectInfo.mode``), which the mount keeps:
a file only root may read stays so. Every directory is listed as a marker ("a/b/", and "" for
the dataset directory itself), so empty directories appear in the mount.

Symlinks: one that resolves to a regular file inside the directory is listed as that file (with
the target's mode and owner); any other (pointing outside, to a directory — which could loop —,
dangling) is listed with its own symlink type, as are FIFOs, sockets and devices: the snapshot
builder skips and counts them. Every read re-resolves the path and refuses to leave the
directory, so a symlink swapped after the listing cannot expose other files.

ETags are ``f"{mtime_ns:x}-{size:x}"``: a rewrite that changes the size or the mtime is an
:class:`~cachefs.errors.ObjectChanged`, like an S3 etag mismatch.
"""

from __future__ import annotations

import builtins
import os
import stat
from collections.abc import Iterator

from cachefs import errors
from cachefs.store.base import ObjectInfo, StoreConfig
from cachefs.store.uri import parse_uri

_CHANGED = "the file changed since the dataset snapshot (refresh the dataset)"


def etag_of(st: os.stat_result) -> str:
    """The local store's version tag of a file."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


class LocalStore:
    """An :class:`~cachefs.store.base.ObjectStore` over a local directory."""

    def __init__(self, config: StoreConfig):
        source = parse_uri(config.uri)
        if source.scheme != "file":
            raise errors.ConfigError(
                f"LocalStore cannot open {config.uri!r}: it is not a file:// URI"
            )
        self._root = source.path
        self._dataset = config.dataset
        self.description = str(source)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Depth-first walk in ascending byte order of the keys, directory markers included.

        Sorting each directory by name alone would be wrong: a directory ``a`` holds keys
        ``a/...``, which sort after a sibling file ``a-b`` ("/" is 0x2F, "-" is 0x2D) but before
        ``a0``. So a directory is sorted as its name plus "/" — its marker's key, which comes
        right before everything in it —, and the walk yields keys in exactly the order a sort
        of all full keys would.
        """
        real_root = self._real_root()
        # Start at the deepest directory the prefix names: "train/n01" starts at "train".
        start = prefix.rpartition("/")[0]
        if prefix in ("", f"{start}/"):  # the prefix is that directory's marker ("" the root's)
            marker = self._directory_marker(real_root, start)
            if marker is not None:
                yield marker
        stack: builtins.list[Iterator[tuple[str, ObjectInfo | None]]] = [
            iter(self._sorted_children(real_root, start, prefix))
        ]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                continue
            key, info = child
            if info is not None:
                yield info
            if key.endswith("/"):  # a directory: its marker (if under the prefix), then inside
                stack.append(iter(self._sorted_children(real_root, key[:-1], prefix)))

    def head(self, key: str) -> ObjectInfo:
        path = self._path_of(key)
        try:
            st = os.stat(path)
        except OSError as err:
            raise self._map_os_error(err, key) from err
        if not stat.S_ISREG(st.st_mode):
            raise self._error(errors.ObjectNotFound, "not a regular file", key)
        return _info(key, st)

    def get_range(self, key: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        path = self._path_of(key)
        try:
            # O_NONBLOCK: opening a FIFO that took a file's place must not hang the reader; the
            # regular-file check below then refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as err:
            raise self._map_os_error(err, key) from err
        try:
            self._check_version(fd, key, etag)
            data = _pread_up_to(fd, offset, length)
            # Re-check: a rewrite during the read could have mixed old and new bytes (and a
            # file that shrank is a changed file, not a short read).
            self._check_version(fd, key, etag)
        except OSError as err:
            raise self._map_os_error(err, key) from err
        finally:
            os.close(fd)
        if len(data) != length:
            raise self._error(
                errors.StoreIOError,
                f"the file ended after {offset + len(data)} bytes; {offset + length} were expected",
                key,
            )
        return data

    def prepare_reads(self) -> None:
        """Nothing to set up: every read opens its file."""

    def close(self) -> None:
        """Nothing to release: files are opened and closed per call."""

    # --- internals --------------------------------------------------------------------------

    def _real_root(self) -> str:
        real_root = os.path.realpath(self._root)
        if not os.path.isdir(real_root):
            raise self._error(errors.StoreBucketNotFound, "the directory does not exist", "")
        return real_root

    def _sorted_children(
        self, real_root: str, rel_dir: str, prefix: str
    ) -> builtins.list[tuple[str, ObjectInfo | None]]:
        """(key, info) of the entries of ``rel_dir`` that can hold keys starting with
        ``prefix``, in walk order. A subdirectory's key ends in "/"; its info (its marker) is
        None when only keys below it start with the prefix."""
        children: builtins.list[tuple[bytes, str, ObjectInfo | None]] = []
        for entry in self._scandir(real_root, rel_dir):
            key = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            sort_name = os.fsencode(entry.name)
            if entry.is_dir(follow_symlinks=False):
                marker = key + "/"
                if marker.startswith(prefix):
                    info = self._lstat_info(entry, marker)
                    if info is not None:
                        children.append((sort_name + b"/", marker, info))
                elif prefix.startswith(marker):
                    children.append((sort_name + b"/", marker, None))
            elif not key.startswith(prefix):
                continue
            elif entry.is_symlink():
                info = self._followed_symlink(real_root, entry, key)
                if info is not None:
                    children.append((sort_name, key, info))
            else:  # a regular file, or a FIFO, socket or device for the builder to count
                info = self._lstat_info(entry, key)
                if info is not None:
                    children.append((sort_name, key, info))
        children.sort(key=lambda child: child[0])
        return [(key, info) for _, key, info in children]

    def _directory_marker(self, real_root: str, rel_dir: str) -> ObjectInfo | None:
        """The marker of directory ``rel_dir`` ("" the root), None if it is not a directory."""
        path = os.path.join(real_root, rel_dir) if rel_dir else real_root
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            raise self._map_os_error(err, rel_dir + "/") from err
        return _info(f"{rel_dir}/" if rel_dir else "", st) if stat.S_ISDIR(st.st_mode) else None

    def _lstat_info(self, entry: os.DirEntry[str], key: str) -> ObjectInfo | None:
        """The entry as listed (not following a symlink); None if it was deleted meanwhile."""
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None  # deleted since the directory was read
        except OSError as err:
            raise self._map_os_error(err, key) from err
        return _info(key, st)

    def _scandir(self, real_root: str, rel_dir: str) -> builtins.list[os.DirEntry[str]]:
        path = os.path.join(real_root, rel_dir) if rel_dir else real_root
        try:
            with os.scandir(path) as entries:
                return list(entries)
        except (FileNotFoundError, NotADirectoryError):
            # The prefix names no directory, or it was removed while we walked: no keys there.
            return []
        except OSError as err:
            raise self._map_os_error(err, rel_dir + "/") from err

    def _followed_symlink(
        self, real_root: str, entry: os.DirEntry[str], key: str
    ) -> ObjectInfo | None:
        """The ObjectInfo of the target of a symlink to a regular file inside the root; for any
        other symlink, that of the symlink itself (its type tells the builder to skip it)."""
        target = os.path.realpath(entry.path)
        try:
            st = os.stat(target)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode) or not _is_inside(real_root, target):
            return self._lstat_info(entry, key)
        return _info(key, st)

    def _path_of(self, key: str) -> str:
        """The resolved path of ``key``, refusing anything that leaves the root."""
        if "\0" in key or any(part in ("", ".", "..") for part in key.split("/")):
            raise self._error(errors.ObjectNotFound, "not a valid object key", key)
        real_root = self._real_root()
        path = os.path.realpath(os.path.join(real_root, key))
        if not _is_inside(real_root, path):
            raise self._error(
                errors.ObjectNotFound, "the path leads outside the dataset directory", key
            )
        return path

    def _check_version(self, fd: int, key: str, etag: str | None) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise self._error(errors.ObjectNotFound, "not a regular file", key)
        if etag is not None and etag_of(st) != etag:
            raise self._error(errors.ObjectChanged, _CHANGED, key)

    def _map_os_error(self, err: OSError, key: str) -> errors.StoreError:
        """The one place where OS errors become store errors (strerror only: no paths)."""
        if isinstance(err, (FileNotFoundError, NotADirectoryError)):
            return self._error(errors.ObjectNotFound, "the file does not exist", key)
        if isinstance(err, PermissionError):
            return self._error(errors.StoreAuthError, "permission denied", key)
        return self._error(errors.StoreIOError, f"{err.strerror or type(err).__name__}", key)

    def _error(self, kind: type[errors.StoreError], cause: str, key: str) -> errors.StoreError:
        return kind(cause, dataset=self._dataset, key=key, store=self.description)


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    """What the listing says of a file (or, with a key ending in "/", of a directory; or of an
    entry of another type, which the builder skips: see the module docstring)."""
    if not stat.S_ISREG(st.st_mode):
        return ObjectInfo(key, 0, "", st.st_mtime_ns, st.st_mode, st.st_uid, st.st_gid)
    return ObjectInfo(
        key=key,
        size=st.st_size,
        etag=etag_of(st),
        mtime_ns=st.st_mtime_ns,
        mode=st.st_mode,
        uid=st.st_uid,
        gid=st.st_gid,
    )


def _pread_up_to(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes from ``offset``, or fewer if the file ends first (pread may return
    less than asked even before the end, so keep reading until it returns nothing)."""
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    chunks = [data]
    read = len(data)
    while read < length:
        chunk = os.pread(fd, length - read, offset + read)
        if not chunk:
            break
        chunks.append(chunk)
        read += len(chunk)
    return b"".join(chunks)


def _is_inside(real_root: str, real_path: str) -> bool:
    return os.path.commonpath([real_root, real_path]) == real_root
