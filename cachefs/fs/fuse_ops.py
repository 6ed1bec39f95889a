"""Thin pyfuse3 adapter over ``cachefs.fs.core`` — and the only place that maps errors to errno.

Each handler converts arguments, calls the core, converts the result. Every error reaching the
kernel, the fixed answers of the operations a read-only mount refuses included, is a cachefs
error that passes through :data:`ERRNO_BY_ERROR` (:meth:`FuseOperations._fail`, which also
counts it in ``cachefs_fuse_errors_total``). Per-request cost is the budget to beat: a request
that reaches Python costs ~90-190 µs of worker CPU, a third of it cachefs's own code
(bench/README.md, "Where the time goes"), so handlers do no logging on success and no
allocation beyond the reply.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import struct
import time
from collections.abc import Coroutine, Sequence
from typing import Any, NoReturn, Protocol, cast

import pyfuse3

from cachefs.errors import (
    BadFileHandle,
    CachefsError,
    ConfigError,
    IsADirectory,
    NotADirectory,
    NotASymlink,
    NotSupported,
    PathNotFound,
    ReadOnly,
    StoreError,
)
from cachefs.fs.core import MOUNT_ROOT, SLOT_SHIFT, Attr, FileSystem
from cachefs.fs.native_reads import NATIVE_LISTING_BYTES
from cachefs.metrics import WorkerMetrics

log = logging.getLogger("cachefs.fuse")

#: True when pyfuse3 carries cachefs's patch (third_party/pyfuse3/build.py).
NO_OPEN_SUPPORTED = bool(getattr(pyfuse3, "READ_FH_FALLS_BACK_TO_INODE", False))
#: True when that patch includes the native READ fast path (``pyfuse3.fast_read_*``).
FAST_READ_SUPPORTED = bool(getattr(pyfuse3, "FAST_READ", False))
#: True when it also sends READs of other workers' files to them (``pyfuse3.fast_peer_open``).
PEER_READS_SUPPORTED = FAST_READ_SUPPORTED and hasattr(pyfuse3, "fast_peer_open")
#: Directories remembered as not listable natively (too large to pack), before forgetting all.
UNLISTED_REMEMBERED = 4096
#: True when it can also serve the mount from more processes (``pyfuse3.init_clone``).
CLONES_SUPPORTED = FAST_READ_SUPPORTED and hasattr(pyfuse3, "init_clone")
#: A READDIR a serving process forwards gets at most this many entries (its reply takes what
#: fits; the kernel asks again from there).
FORWARDED_READDIR_ENTRIES = 512
#: What a forwarded request's handler gets for its request context (none is used).
_NO_CONTEXT = cast(pyfuse3.RequestContext, None)
#: FUSE_DEV_IOC_CLONE (linux/fuse.h: _IOR(229, 0, uint32_t)): a new /dev/fuse descriptor reads
#: the connection of the descriptor named.
FUSE_DEV_IOC_CLONE = 0x8004E500
#: File handles are small counters; dataset inodes are >= 1 << SLOT_SHIFT. A read "handle" at or
#: above this is an inode (no-open mode).
INODE_FH_THRESHOLD = 1 << SLOT_SHIFT

#: The one mapping of errors to the errno the kernel gets. Anything else is EIO, logged.
ERRNO_BY_ERROR: tuple[tuple[type[CachefsError], int], ...] = (
    (PathNotFound, errno.ENOENT),
    (ReadOnly, errno.EROFS),  # every write operation, and access() asking for write
    (NotADirectory, errno.ENOTDIR),
    (IsADirectory, errno.EISDIR),
    (BadFileHandle, errno.EBADF),
    # Extended attributes, and OPEN in no-open mode: the kernel remembers ENOSYS and stops
    # sending the operation (for xattrs ENOATTR would bring every `ls -l` back to Python).
    (NotSupported, errno.ENOSYS),
    (NotASymlink, errno.EINVAL),  # readlink: the mount has no symbolic links
)


def _errno_of(exc: Exception, op: str) -> int:
    """The errno for an exception. Anything unexpected is EIO with one log line that names the
    dataset, key and cause (StoreError messages carry them)."""
    for exc_type, code in ERRNO_BY_ERROR:
        if isinstance(exc, exc_type):
            return code
    if isinstance(exc, StoreError | CachefsError):
        log.error("%s failed: %s", op, exc)
    else:
        log.exception("%s failed with an unexpected error", op)
    return errno.EIO


class FuseOperations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        fs: FileSystem,
        metrics: WorkerMetrics,
        *,
        entry_timeout: float = 3600.0,
        attr_timeout: float = 3600.0,
        no_open: bool | None = None,
    ):
        super().__init__()
        # No-open mode: answer the first OPEN with ENOSYS, after which the kernel sends no
        # OPEN/RELEASE at all and keeps page caches across opens (warm reads never reach
        # Python). Needs read() to learn the inode, which only the patched pyfuse3 does.
        if no_open is None:
            no_open = NO_OPEN_SUPPORTED
        elif no_open and not NO_OPEN_SUPPORTED:
            raise ValueError("no-open mode needs the patched pyfuse3 (third_party/pyfuse3)")
        self.no_open = no_open
        self.fs = fs
        self.metrics = metrics
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self._read_latency = metrics.fuse_latency.get("read")
        self._lookup_latency = metrics.fuse_latency.get("lookup")
        self._getattr_latency = metrics.fuse_latency.get("getattr")
        self._open_latency = metrics.fuse_latency.get("open")
        self._readdir_latency = metrics.fuse_latency.get("readdir")
        # The binding's native table (set by the worker when the native path serves): LOOKUP
        # replies are remembered there, and answered in C when the kernel asks again after it
        # dropped the dentry (memory pressure, `echo 3 > drop_caches`). Forgotten with the
        # dataset's inodes on a refresh or removal (FileSystem._changed).
        self.native_lookups: _PyfuseNativeReadTable | None = None
        self._unlisted: set[int] = set()

    def use_native_table(self, table: _PyfuseNativeReadTable) -> None:
        """Remember LOOKUP replies and whole directory listings in the binding's table (its
        READDIRPLUS replies carry this adapter's timeouts)."""
        table.configure_listings(NATIVE_LISTING_BYTES, self.entry_timeout, self.attr_timeout)
        self.native_lookups = table
        self.fs.lookup_prepared = self._lookup_prepared

    def _lookup_prepared(self, parent_inode: int, name: bytes, attr: Attr) -> None:
        """A LOOKUP reply the core prepared (FileSystem.prepare_reads): into the table, as
        :meth:`lookup` puts the replies it gives."""
        if self.native_lookups is not None:
            self.native_lookups.register_dentry(parent_inode, name, self._entry(attr))

    # --- helpers -----------------------------------------------------------------------------

    def _entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attr.ino
        entry.generation = 0
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.attr_timeout
        entry.st_mode = attr.mode
        entry.st_nlink = attr.nlink
        entry.st_uid = attr.uid
        entry.st_gid = attr.gid
        entry.st_rdev = 0
        entry.st_size = attr.size
        entry.st_blksize = 1 << 17
        entry.st_blocks = (attr.size + 511) // 512
        entry.st_atime_ns = attr.mtime_ns
        entry.st_mtime_ns = attr.mtime_ns
        entry.st_ctime_ns = attr.mtime_ns
        return entry

    def _fail(self, exc: Exception, op: str) -> pyfuse3.FUSEError:
        code = _errno_of(exc, op)
        name = errno.errorcode.get(code, str(code))
        self.metrics.fuse_errors[name] = self.metrics.fuse_errors.get(name, 0) + 1
        return pyfuse3.FUSEError(code)

    # --- namespace ---------------------------------------------------------------------------

    async def lookup(
        self,
        parent_inode: pyfuse3.InodeT,
        name: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext | None = None,
    ) -> pyfuse3.EntryAttributes:
        began = time.perf_counter()
        try:
            entry = self._entry(self.fs.lookup(parent_inode, name))
        except Exception as exc:
            raise self._fail(exc, "lookup") from None
        finally:
            self._lookup_latency.observe(time.perf_counter() - began)
        # Not the datasets under the mount root: adding one changes no inode range to forget.
        if self.native_lookups is not None and parent_inode != MOUNT_ROOT:
            self.native_lookups.register_dentry(parent_inode, name, entry)
        return entry

    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        began = time.perf_counter()
        try:
            return self._entry(self.fs.getattr(inode))
        except Exception as exc:
            raise self._fail(exc, "getattr") from None
        finally:
            self._getattr_latency.observe(time.perf_counter() - began)

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        return  # inodes are derived from the snapshot: nothing to free

    async def opendir(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileHandleT:
        try:
            self.fs.check_directory(inode)
        except Exception as exc:
            raise self._fail(exc, "opendir") from None
        return inode

    def native_listing(self, inode: int) -> bool:
        """Register the whole listing of directory ``inode`` in the binding's table, so that
        OPENDIR and READDIRPLUS of it are answered in C (called by the patched pyfuse3, as a
        plain call, before it hands either request to Python). False when there is no table,
        for the mount root, a directory too large to pack or not a directory: Python answers,
        errors included."""
        table = self.native_lookups
        if table is None or inode in self._unlisted:
            return False
        try:
            packed = self.fs.packed_listing(inode)
        except Exception:
            return False  # the request goes to Python, which gives the error its errno
        if packed is None or not table.register_listing(inode, *packed):
            if len(self._unlisted) >= UNLISTED_REMEMBERED:
                self._unlisted.clear()
            self._unlisted.add(inode)  # too large: not packed again on every open
            return False
        return True

    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        began = time.perf_counter()
        try:
            for name, attr, next_id in self.fs.readdir(fh, start_id):
                if not pyfuse3.readdir_reply(token, name, self._entry(attr), next_id):
                    break
        except Exception as exc:
            raise self._fail(exc, "readdir") from None
        finally:
            self._readdir_latency.observe(time.perf_counter() - began)

    def _readdir_page(
        self, fh: int, start_id: int
    ) -> list[tuple[bytes, pyfuse3.EntryAttributes, int]]:
        """Up to FORWARDED_READDIR_ENTRIES entries from ``start_id``, for a serving process
        (which replies with as many as its reply holds)."""
        began = time.perf_counter()
        try:
            page = []
            for name, attr, next_id in self.fs.readdir(fh, start_id):
                page.append((name, self._entry(attr), next_id))
                if len(page) >= FORWARDED_READDIR_ENTRIES:
                    break
            return page
        except Exception as exc:
            raise self._fail(exc, "readdir") from None
        finally:
            self._readdir_latency.observe(time.perf_counter() - began)

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        total_bytes, total_files = self.fs.totals()
        stats = pyfuse3.StatvfsData()
        stats.f_bsize = 1 << 17
        stats.f_frsize = 4096
        stats.f_blocks = (total_bytes + 4095) // 4096
        stats.f_bfree = stats.f_bavail = 0
        stats.f_files = total_files
        stats.f_ffree = stats.f_favail = 0
        stats.f_namemax = 255
        return stats

    # No extended attributes. ENOSYS, not ENOATTR: the kernel remembers ENOSYS for the whole
    # mount and answers every later getxattr/listxattr itself ("not supported"), where ENOATTR
    # would bring each `ls -l` (security.selinux, system.posix_acl_access) back to Python.
    async def getxattr(
        self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext
    ) -> bytes:
        raise self._fail(NotSupported("the mount has no extended attributes"), "getxattr")

    async def listxattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> Sequence[pyfuse3.XAttrNameT]:
        raise self._fail(NotSupported("the mount has no extended attributes"), "listxattr")

    async def access(
        self, inode: pyfuse3.InodeT, mode: pyfuse3.ModeT, ctx: pyfuse3.RequestContext
    ) -> bool:
        if mode & os.W_OK:
            raise self._fail(ReadOnly("the mount is read-only"), "access")
        return True

    # --- files -------------------------------------------------------------------------------

    async def open(
        self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        began = time.perf_counter()
        try:
            fh = self.fs.open(inode, flags)
        except Exception as exc:
            raise self._fail(exc, "open") from None
        finally:
            self._open_latency.observe(time.perf_counter() - began)
        if self.no_open:
            self.fs.release(fh)
            # The kernel's cue to stop sending OPEN (and RELEASE) for the whole mount.
            raise self._fail(NotSupported("no-open mode"), "open")
        # keep_cache: the page cache survives close(), so later epochs never reach Python.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        began = time.perf_counter()
        if off == 0:  # a file's first bytes: the kernel's first READ of it (files/s)
            self.metrics.files_read += 1
        try:
            if fh >= INODE_FH_THRESHOLD:  # no-open mode: the patched pyfuse3 passed the inode
                return await self.fs.read_inode(fh, off, size)
            return await self.fs.read(fh, off, size)
        except Exception as exc:
            raise self._fail(exc, "read") from None
        finally:
            self._read_latency.observe(time.perf_counter() - began)

    # No flush(): pyfuse3's default answers ENOSYS, after which the kernel stops sending FLUSH
    # on every close() — one fewer trip into Python per file (nothing to flush read-only).

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        self.fs.release(fh)

    # --- every write path: read-only -----------------------------------------------------------

    async def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._fail(ReadOnly("the mount is read-only"), "write")

    setattr = _read_only
    mknod = _read_only
    mkdir = _read_only
    unlink = _read_only
    rmdir = _read_only
    symlink = _read_only
    rename = _read_only
    link = _read_only
    create = _read_only
    write = _read_only
    setxattr = _read_only
    removexattr = _read_only
    fsync = _read_only
    fsyncdir = _read_only

    async def readlink(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileNameT:
        raise self._fail(NotASymlink("the mount has no symbolic links"), "readlink")

    # --- requests a serving process read (cachefs/fs/serving.py) -----------------------------

    async def answer_forwarded(self, op: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """Answer a request that a serving process read from the mount and could not answer in
        C, with this adapter's own handler (the same metrics, table registrations and errors):
        ``(True, reply)`` or ``(False, errno)``, pyfuse3's attribute objects as their
        ``__getstate__()`` (the serving process rebuilds them). The serving process has no
        request context to give (the mount checks permissions in the kernel:
        default_permissions) and FuseOperations uses none."""
        try:
            if op == "lookup":
                return True, (await self.lookup(*args)).__getstate__()
            if op == "getattr":
                return True, (await self.getattr(*args)).__getstate__()
            if op == "read":
                return True, await self.read(*args)
            if op == "opendir":
                # The listing into the table first, as the binding asks before an OPENDIR
                # reaches Python here: the serving processes' tables get it too.
                self.native_listing(args[0])
                return True, await self.opendir(args[0], _NO_CONTEXT)
            if op == "readdir":
                page = self._readdir_page(*args)
                return True, [(name, attr.__getstate__(), next_id) for name, attr, next_id in page]
            if op == "statfs":
                return True, (await self.statfs(_NO_CONTEXT)).__getstate__()
            if op == "open":
                info = await self.open(args[0], args[1], _NO_CONTEXT)
                return True, (info.fh, info.keep_cache, info.direct_io)
            if op == "release":
                await self.release(*args)
                return True, None
            if op == "getxattr":
                return True, await self.getxattr(args[0], args[1], _NO_CONTEXT)
            if op == "listxattr":
                return True, await self.listxattr(args[0], _NO_CONTEXT)
            if op == "access":
                return True, await self.access(args[0], args[1], _NO_CONTEXT)
            if op == "readlink":
                return True, await self.readlink(args[0], _NO_CONTEXT)
            if op == "write":
                await self._read_only()  # raises: EROFS
            log.error("a serving process forwarded an unknown request %r", op)
            return False, errno.ENOSYS
        except pyfuse3.FUSEError as exc:
            return False, exc.errno
        except Exception:  # a request this code does not expect (a bug): that request fails
            log.exception("a forwarded %s failed", op)
            return False, errno.EIO


# default_permissions: the kernel checks every access against the owner and mode bits getattr
# returns (cachefs.fs.core), so a file only root may read in a file:// source stays so.
MOUNT_OPTIONS_BASE = ("subtype=cachefs", "ro", "default_permissions")


def mount_options(*, allow_other: bool) -> set[str]:
    """Without allow_other only the worker's own user may use the mount at all (the kernel's
    rule for FUSE); with it every user may, as far as the mode bits allow."""
    # No max_read: libfuse refuses a mount option that pyfuse3's init() does not also set; the
    # kernel then uses the largest size both sides support (max_pages, 128 KiB to 1 MiB).
    options = set(MOUNT_OPTIONS_BASE)
    # A name of its own for each mount (mountinfo's source field): a restart tells the mount
    # its killed predecessor recorded from a later one on the same path (cachefs/mountpoint.py).
    options.add(f"fsname=cachefs-{secrets.token_hex(6)}")
    if allow_other:
        options.add("allow_other")
    return options


class _CachefsPatch(Protocol):
    """What cachefs's patch adds to pyfuse3 (third_party/pyfuse3/cachefs_fast_read.pxi and
    cachefs_peer_reads.pxi): pyfuse3's own type stubs do not list it. Call it only where
    FAST_READ_SUPPORTED (the ``fast_peer_*`` functions where PEER_READS_SUPPORTED)."""

    def fast_read_configure(self, chunk_size: int, max_blocks: int, max_dentries: int) -> None: ...
    def fast_lookup_register(
        self, parent: int, name: bytes, entry: pyfuse3.EntryAttributes
    ) -> bool: ...
    def fast_read_register(
        self,
        ino: int,
        index: int,
        block_size: int,
        file_size: int,
        file_id: int,
        path: bytes,
        length: int,
        chunk_sums: bytes,
        written_ino: int = 0,
        written_ctime_ns: int = 0,
    ) -> bool: ...
    def fast_read_forget_file(self, file_id: int) -> None: ...

    def fast_peer_register(self, ino: int, name: bytes) -> bool: ...

    def fast_peer_answer(
        self, sock_fd: int, frames: memoryview, max_answers: int
    ) -> tuple[int, int, list[int], tuple[bytes, int, int, int] | None]: ...
    def fast_listing_configure(
        self, max_bytes: int, entry_timeout: float, attr_timeout: float
    ) -> None: ...
    def fast_listing_register(self, dir_inode: int, packed: bytes, count: int) -> bool: ...
    def fast_read_forget_inodes(self, lo: int, hi: int) -> None: ...
    def fast_peer_open(self, sock_fd: int, max_length: int) -> int: ...
    def fast_peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool: ...
    def fast_peer_receive(
        self, slot: int
    ) -> tuple[int, list[Coroutine[Any, Any, None]], int, float]: ...
    def fast_peer_close(self, slot: int, fail: bool) -> list[Coroutine[Any, Any, None]]: ...
    def fast_read_clear(self) -> None: ...
    def cache_listings(self, on: bool) -> None: ...
    def fast_passthrough(self, on: bool) -> None: ...
    def fast_read_stats(self) -> dict[str, int]: ...
    def init_request(self) -> bytes: ...
    def session_descriptor(self) -> int: ...


_patched = cast(_CachefsPatch, pyfuse3)


class _PyfuseNativeReadTable:
    """The patched pyfuse3's fast-read table (cachefs_fast_read.c) as a NativeReadTable."""

    def configure(self, chunk_size: int, max_blocks: int, max_names: int) -> None:
        _patched.fast_read_configure(chunk_size, max_blocks, max_names)

    def register_dentry(self, parent: int, name: bytes, entry: pyfuse3.EntryAttributes) -> bool:
        return _patched.fast_lookup_register(parent, name, entry)

    def register(
        self,
        ino: int,
        index: int,
        block_size: int,
        file_size: int,
        file_id: int,
        path: bytes,
        length: int,
        chunk_checksums: bytes,
        written_ino: int = 0,
        written_ctime_ns: int = 0,
    ) -> bool:
        return _patched.fast_read_register(
            ino, index, block_size, file_size, file_id, path, length, chunk_checksums,
            written_ino, written_ctime_ns,
        )  # fmt: skip

    def forget_file(self, file_id: int) -> None:
        _patched.fast_read_forget_file(file_id)

    def register_peer_name(self, ino: int, identity: bytes) -> bool:
        return _patched.fast_peer_register(ino, identity)

    def answer_peers(
        self, sock_fd: int, frames: memoryview, max_answers: int
    ) -> tuple[int, int, list[int], tuple[bytes, int, int, int] | None]:
        return _patched.fast_peer_answer(sock_fd, frames, max_answers)

    def configure_listings(self, max_bytes: int, entry_timeout: float, attr_timeout: float) -> None:
        _patched.fast_listing_configure(max_bytes, entry_timeout, attr_timeout)

    def register_listing(self, dir_ino: int, packed: bytes, count: int) -> bool:
        return _patched.fast_listing_register(dir_ino, packed, count)

    def forget_inodes(self, lo: int, hi: int) -> None:
        _patched.fast_read_forget_inodes(lo, hi)

    def clear(self) -> None:
        _patched.fast_read_clear()

    # The peer reads (cachefs/fs/native_peer_reads.py's PeerReadTable): PEER_READS_SUPPORTED.
    def peer_open(self, sock_fd: int, max_length: int) -> int:
        return _patched.fast_peer_open(sock_fd, max_length)

    def peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool:
        return _patched.fast_peer_route(ino, slot, frame, length)

    def peer_receive(self, slot: int) -> tuple[int, list[Coroutine[Any, Any, None]], int, float]:
        return _patched.fast_peer_receive(slot)

    def peer_close(self, slot: int, fail: bool) -> list[Coroutine[Any, Any, None]]:
        return _patched.fast_peer_close(slot, fail)

    def stats(self) -> dict[str, int]:
        return _patched.fast_read_stats()


def largest_read() -> int:
    """The largest READ the kernel sends on the mounted connection, as the patched binding
    negotiated it at INIT (it lowers it to what its splice pipes hold); 0 with stock pyfuse3
    or before INIT."""
    return _patched.fast_read_stats().get("max_read", 0) if FAST_READ_SUPPORTED else 0


def check_fast_read_possible(no_open: bool | None) -> None:
    """ConfigError unless READs can be answered natively: the patched pyfuse3, no-open mode
    (``no_open`` None: on when that pyfuse3 is installed)."""
    if not FAST_READ_SUPPORTED:
        raise ConfigError(
            "--fuse-fast-read on needs the patched pyfuse3 (python third_party/pyfuse3/build.py)"
        )
    if no_open is False:
        raise ConfigError("--fuse-fast-read on needs no-open mode (--fuse-no-open on)")


def check_passthrough_possible(fast_read: bool | None, no_open: bool | None) -> None:
    """ConfigError unless passthrough can be asked for: it is part of the native path (the
    binding answers OPEN and RELEASE and hands it the table's blocks)."""
    if not FAST_READ_SUPPORTED:
        raise ConfigError(
            "--fuse-passthrough on needs the patched pyfuse3 (python third_party/pyfuse3/build.py)"
        )
    if fast_read is False or no_open is False:
        raise ConfigError(
            "--fuse-passthrough on needs the native path (--fuse-fast-read and --fuse-no-open "
            "on or auto)"
        )


def check_clones_possible(passthrough: bool | None) -> None:
    """ConfigError unless the mount can be served by more processes (--fuse-processes > 1):
    the patched pyfuse3's clones, and no passthrough (the kernel's backing files are ids of
    one /dev/fuse descriptor, which the OPENs other processes answer could not name)."""
    if not CLONES_SUPPORTED:
        raise ConfigError(
            "--fuse-processes above 1 needs the patched pyfuse3 "
            "(python third_party/pyfuse3/build.py)"
        )
    if passthrough:
        raise ConfigError("--fuse-passthrough on needs --fuse-processes 1")


def native_read_table(wanted: bool | None, no_open: bool) -> _PyfuseNativeReadTable | None:
    """The binding's fast-read table when READs of cached blocks are to be answered in C;
    None when they are not (``wanted`` False, or None and the binding or mode lacks it: said
    once in the log). ``wanted`` True and not possible: ConfigError."""
    if wanted is False:
        return None
    if wanted:
        check_fast_read_possible(no_open)
    if not FAST_READ_SUPPORTED:
        log.warning(
            "pyfuse3 has no cachefs fast-read patch: every READ is served in Python "
            "(for the native path: python third_party/pyfuse3/build.py)"
        )
        return None
    if not no_open:
        log.info("FUSE open mode: every READ is served in Python (the native path needs no-open)")
        return None
    return _PyfuseNativeReadTable()


def mount(
    ops: FuseOperations, mountpoint: str, options: set[str], *, passthrough: bool = False
) -> None:
    """Mount; ``passthrough``: ask the kernel for FUSE passthrough when the native path
    serves (granted or not: ``native_stats()['passthrough']`` once INIT is answered)."""
    # With the native path on, the kernel also keeps directory listings until a refresh
    # invalidates the directories whose entries changed (Worker._invalidate_changes): a warm
    # `ls -lR`/`find` stays in the kernel. Off (or stock pyfuse3): listings reach Python.
    if FAST_READ_SUPPORTED:
        native = ops.native_lookups is not None
        _patched.cache_listings(native)
        _patched.fast_passthrough(native and passthrough)
    pyfuse3.init(ops, mountpoint, options)


async def serve(max_tasks: int) -> None:
    """Run pyfuse3's request loop until :func:`terminate` is called."""
    await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)


def terminate() -> None:
    pyfuse3.terminate()


def unmount() -> None:
    pyfuse3.close(unmount=True)


def clones_ready() -> bool:
    """True once the mount's FUSE_INIT is kept for serving processes (the patched binding keeps
    one of at most CFR_INIT_REQUEST_MAX bytes)."""
    return CLONES_SUPPORTED and bool(_patched.init_request())


def clone_session() -> tuple[int, bytes]:
    """A new /dev/fuse descriptor reading the mounted connection (FUSE_DEV_IOC_CLONE; the
    caller's to close) and the FUSE_INIT request that connection began with, for a serving
    process (``pyfuse3.init_clone``). Call once INIT is answered (OSError before, or without
    the patched pyfuse3's clones: CLONES_SUPPORTED)."""
    request: bytes = _patched.init_request()
    session = _patched.session_descriptor()
    if not request or session < 0:
        raise OSError(errno.EAGAIN, "the mount has not answered FUSE_INIT yet")
    # Non-blocking, this descriptor and the clone: every process waits for the connection to
    # be readable and then reads, and another may have taken the request it was woken for. A
    # blocking read would then stop that process's loop until the next request, with the
    # requests it forwarded to the worker waiting on it (the patched loop waits again on
    # EAGAIN: third_party/pyfuse3/build.py).
    os.set_blocking(session, False)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", session))
    except BaseException:
        os.close(fd)
        raise
    return fd, request


def invalidate_inode(ino: int) -> None:
    """Drop the kernel's cached attributes and pages of one inode (blocking; call in a thread)."""
    pyfuse3.invalidate_inode(ino, attr_only=False)


def invalidate_entry(parent: int, name: bytes) -> None:
    """Drop the kernel's dentry for ``name`` under ``parent`` (blocking; call in a thread)."""
    pyfuse3.invalidate_entry(parent, name)
