"""The worker's FUSE mount: made, served, tuned and taken down, and the kernel's caches of it
told what changed. The mountpoint itself (checked, a dead mount cleared, recorded for the next
start) is cachefs/mountpoint.py's; the requests are the FUSE adapter's (fuse_ops.py).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from cachefs.cache.base import BlockCache
from cachefs.errors import ConfigError
from cachefs.fs import fuse_ops
from cachefs.fs.core import FileSystem
from cachefs.fs.native_peer_reads import NativePeerReads
from cachefs.fs.native_reads import NativeReads
from cachefs.fs.serving import ReplicatedTable, ServingProcesses
from cachefs.metrics import WorkerMetrics

log = logging.getLogger("cachefs.worker")

#: The most processes one mount is served by (--fuse-processes).
MAX_FUSE_PROCESSES = 64


class FuseMount:
    """One mount of ``fs`` at ``mountpoint``; ``no_open``, ``fast_read`` and ``passthrough``
    as the settings say (None: decided from the pyfuse3 that is installed, and for passthrough
    from what the kernel grants)."""

    def __init__(
        self,
        fs: FileSystem,
        cache: BlockCache,
        metrics: WorkerMetrics,
        *,
        mountpoint: str,
        allow_other: bool,
        entry_timeout: float,
        attr_timeout: float,
        no_open: bool | None,
        fast_read: bool | None,
        passthrough: bool | None,
        max_tasks: int,
        fuse_processes: int = 1,
    ) -> None:
        self._fs = fs
        self._cache = cache
        self._metrics = metrics
        self.mountpoint = mountpoint
        self._allow_other = allow_other
        self._entry_timeout = entry_timeout
        self._attr_timeout = attr_timeout
        self._want_no_open = no_open
        self._want_fast_read = fast_read
        self._want_passthrough = passthrough
        self._max_tasks = max_tasks
        self._fuse_processes = fuse_processes
        self.serving: ServingProcesses | None = None  # further processes (fs/serving.py)
        self._initialised = trio.Event()  # INIT answered: serving processes may clone
        self.mounted = False
        self.no_open = False  # as decided when mounted

    def mount(self) -> None:
        """Mount (a ConfigError if the kernel refuses), with the native READ path when it
        serves."""
        ops = fuse_ops.FuseOperations(
            self._fs,
            self._metrics,
            entry_timeout=self._entry_timeout,
            attr_timeout=self._attr_timeout,
            no_open=self._want_no_open,
        )
        self.no_open = ops.no_open
        table: Any = fuse_ops.native_read_table(self._want_fast_read, ops.no_open)
        if not 1 <= self._fuse_processes <= MAX_FUSE_PROCESSES:
            raise ConfigError(
                f"--fuse-processes: from 1 to {MAX_FUSE_PROCESSES} (got {self._fuse_processes})"
            )
        if self._fuse_processes > 1:
            fuse_ops.check_clones_possible(self._want_passthrough)
            self._want_passthrough = False  # "auto": the serving processes cannot hand out files
            if table is not None:
                table = ReplicatedTable(table)
            self.serving = ServingProcesses(
                self._fuse_processes, ops, table, max_tasks=self._max_tasks
            )
            self._metrics.serving = self.serving.stats
        if table is not None:
            self._fs.native = NativeReads(table, self._cache, self._fs.reader)
            ops.use_native_table(table)
            self._metrics.native_reads = self._fs.native.stats
            reader = self._fs.reader
            if reader.peers is not None and fuse_ops.PEER_READS_SUPPORTED:
                self._fs.native_peers = NativePeerReads(
                    table,
                    reader,
                    reader.peers,
                    timeout_s=reader.peers.timeout_s,
                    largest_read=fuse_ops.largest_read,
                    # Each serving process sends its READs of peers' files on connections of
                    # its own (the worker opens and hands them over).
                    sharing=table if isinstance(table, ReplicatedTable) else None,
                )
        try:
            fuse_ops.mount(
                ops,
                self.mountpoint,
                fuse_ops.mount_options(allow_other=self._allow_other),
                passthrough=self._want_passthrough is not False,
            )
        except RuntimeError as exc:  # pyfuse3's only word for it; libfuse logs the reason
            raise ConfigError(f"cannot mount {self.mountpoint}: {exc}") from None
        self.mounted = True

    async def serve(self) -> None:
        """Answer the kernel's requests until :meth:`terminate` (or an unmount from outside),
        with the serving processes once INIT is answered; they are stopped before this
        returns."""
        native_peers = self._fs.native_peers
        if native_peers is None and self.serving is None:
            await fuse_ops.serve(self._max_tasks)
            return
        async with trio.open_nursery() as nursery:
            if native_peers is not None:  # its READs are answered on this session
                await nursery.start(native_peers.run)
            if self.serving is not None:
                nursery.start_soon(self._run_serving, self.serving)
            await fuse_ops.serve(self._max_tasks)
            nursery.cancel_scope.cancel()

    async def _run_serving(self, serving: ServingProcesses) -> None:
        await self._initialised.wait()
        await serving.run(cache_listings=self._fs.native is not None)

    def serving_stats(self) -> dict[str, Any] | None:
        """The serving processes' figures (ServingProcesses.stats); None with one process."""
        return None if self.serving is None else self.serving.stats()

    def terminate(self) -> None:
        fuse_ops.terminate()

    def unmount(self) -> None:
        # The native table first, while the session's /dev/fuse is still open: emptying it
        # closes the kernel ids of its backing files (passthrough) on that descriptor.
        native = self._fs.native
        if native is not None:
            self._metrics.native_reads = native.stats().copy  # keep the last counts
            native.close()
            self._fs.native = None
            self._fs.native_peers = None
        fuse_ops.unmount()
        self.mounted = False

    async def wait_for_init(self, mount_path: str) -> None:
        """Return once the FUSE loop has answered INIT (always the first request): a stat()
        served by the loop proves it. ``mount_path``: the mountpoint, resolved before it became
        a FUSE mount."""
        await trio.to_thread.run_sync(os.stat, mount_path)
        self._initialised.set()

    def set_readahead(self, mount_path: str, kib: int) -> None:
        """The mount's kernel readahead; call after :meth:`wait_for_init` (the kernel applies
        the INIT reply's limit when INIT is answered, which would overwrite ours).

        At most the largest READ: the patched binding lowers that below 1 MiB where the splice
        pipes cannot hold 1 MiB (no CAP_SYS_RESOURCE, fs.pipe-max-size 1 MiB), and a readahead
        window one READ larger would cost a second, tiny READ per window."""
        largest_read_kib = fuse_ops.largest_read() // 1024
        if 0 < largest_read_kib < kib:
            log.info(
                "readahead %d KiB, not %d: the largest READ whose reply is spliced",
                largest_read_kib,
                kib,
            )
            kib = largest_read_kib
        set_readahead(mount_path, kib)

    def say_passthrough(self) -> None:
        """Log, once INIT is answered, whether the kernel granted the passthrough asked for."""
        native = self._fs.native
        if not self._want_passthrough or native is None:
            return
        if native.stats().get("passthrough"):
            log.info("FUSE passthrough on: cached small files are read by the kernel")
        else:
            log.warning(
                "FUSE passthrough asked for but not granted by the kernel (needs Linux >= 6.9 "
                "with CONFIG_FUSE_PASSTHROUGH): reads go through the native READ path"
            )

    # --- the kernel's caches: what a refresh or a removal changed ---------------------------

    async def forget_inode(self, ino: int) -> None:
        """The kernel drops the inode's cached pages and attributes (its listing, for a
        directory)."""
        await self._forget(partial(fuse_ops.invalidate_inode, ino))

    async def forget_entry(self, parent: int, name: bytes) -> None:
        """The kernel drops its cached lookup of ``name`` in ``parent``."""
        await self._forget(partial(fuse_ops.invalidate_entry, parent, name))

    async def forget_inodes(self, inodes: list[int]) -> None:
        """:meth:`forget_inode` of each, in one thread call."""
        if not self.mounted or not inodes:
            return

        def forget_all() -> None:
            for ino in inodes:
                try:
                    fuse_ops.invalidate_inode(ino)
                except OSError as exc:
                    _unless_not_cached(exc)

        await trio.to_thread.run_sync(forget_all)

    async def _forget(self, call: Callable[[], None]) -> None:
        if not self.mounted:
            return
        try:
            await trio.to_thread.run_sync(call)
        except OSError as exc:
            _unless_not_cached(exc)


def _unless_not_cached(exc: OSError) -> None:
    """An invalidation of what the kernel has not cached fails with ENOENT (ENOTDIR): nothing
    to forget. Any other failure is logged."""
    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
        log.warning("kernel cache invalidation failed: %s", exc)


def set_readahead(mount_path: str, kib: int) -> None:
    """Set the mount's readahead through its backing-device entry in sysfs (root only).

    ``mount_path`` must be already resolved, and the device number comes from
    /proc/self/mountinfo: any stat() of the mount would wait for a GETATTR reply that this
    thread, not yet serving FUSE, could never send."""
    device = None
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if fields[4] == mount_path:
                device = fields[2]  # "major:minor"; the last match is the newest mount
    if device is None:
        log.warning("readahead not set: %s not found in /proc/self/mountinfo", mount_path)
        return
    path = f"/sys/class/bdi/{device}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.warning("could not set readahead of %s to %d KiB: %s", mount_path, kib, exc)
