"""The datasets a worker serves: added (its source listed into a snapshot, then mounted under
the mountpoint), refreshed (listed again, the new snapshot swapped in, the kernel told what
changed), removed, reopened at start, and described for `cachefs status`.

One lock per dataset orders the changes of one dataset; the blocking parts (store clients,
LMDB writes, snapshot builds, directory removal) run in threads, so the FUSE loop never waits
on them. A worker that follows a coordinator takes its datasets from the coordinator's view
(the ``*_followed`` calls of the heartbeat agent) and refuses the control API's changes.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import trio

from cachefs.cache.base import BlockCache, source_id_of
from cachefs.cluster.preload import PreloadSource
from cachefs.errors import CachefsError, ConfigError, DatasetExists, EmptySource
from cachefs.fs.blocks import DataSource
from cachefs.fs.core import MOUNT_ROOT, FileSystem, MountedDataset
from cachefs.fs.native_reads import PREPARED_BLOCKS_MAX, PREPARED_FILES_MAX
from cachefs.meta import BuildResult, Entry, Snapshot, SnapshotError, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.protocol import DatasetSpec
from cachefs.registry import Registry
from cachefs.store import StoreConfig, open_store
from cachefs.store.base import RetryPolicy
from cachefs.store.uri import parse_uri

log = logging.getLogger("cachefs.worker")

T = TypeVar("T")

#: Files prepared between two checkpoints of the trio loop (~30 us each, plus ~10 us per
#: block registered).
PREPARE_BATCH = 128


async def prepare_in_batches(
    prepare: Callable[[str, Sequence[str], int], tuple[int, int]],
    dataset: str,
    keys: Sequence[str],
) -> int:
    """``prepare`` (FileSystem.prepare_reads) over ``keys`` in batches of
    :data:`PREPARE_BATCH`, with a checkpoint after each, within the caps of
    :data:`PREPARED_FILES_MAX` files and :data:`PREPARED_BLOCKS_MAX` blocks; the files
    prepared. An exception is logged and ends it (the reads then reach Python as before)."""
    files = blocks = 0
    keys = keys[:PREPARED_FILES_MAX]
    for start in range(0, len(keys), PREPARE_BATCH):
        try:
            done, registered = prepare(
                dataset, keys[start : start + PREPARE_BATCH], PREPARED_BLOCKS_MAX - blocks
            )
        except Exception:  # a damaged snapshot, LMDB out of readers, a bug: reads still work
            log.exception("preparing native reads of %r stopped", dataset)
            break
        files, blocks = files + done, blocks + registered
        await trio.sleep(0)
    return files


class KernelCache(Protocol):
    """What the kernel keeps of the mount (the FUSE mount, cachefs/fs/mount.py): told to
    forget what changed. Each call does nothing while nothing is mounted."""

    async def forget_inode(self, ino: int) -> None: ...
    async def forget_entry(self, parent: int, name: bytes) -> None: ...
    async def forget_inodes(self, inodes: list[int]) -> None: ...


def store_config(spec: DatasetSpec) -> StoreConfig:
    """How a dataset's store is opened: by the worker, and by `cachefs dataset add` probing it."""
    return StoreConfig(
        uri=spec.uri,
        endpoint=spec.endpoint,
        region=spec.region,
        path_style=spec.path_style,
        profile=spec.profile,
        credentials_file=spec.credentials_file,
        retry=RetryPolicy(
            deadline_s=spec.timeout_s, first_byte_timeout_s=spec.first_byte_timeout_s
        ),
        dataset=spec.name,
    )


class DatasetManager:
    def __init__(
        self,
        fs: FileSystem,
        cache: BlockCache,
        registry: Registry,
        metrics: WorkerMetrics,
        kernel: KernelCache,
        *,
        state_dir: str,
        coordinator: str | None,
        started_at: float,
    ) -> None:
        """``coordinator``: the URL this worker follows (its datasets come from there), or
        None; ``started_at``: the time periodic refreshes count from."""
        self._fs = fs
        self._cache = cache
        self._registry = registry
        self._metrics = metrics
        self._kernel = kernel
        self._snapshot_root = os.path.join(state_dir, "snapshots")
        self._coordinator = coordinator
        self._started_at = started_at
        self._build_limiter = trio.CapacityLimiter(2)
        self._admin_limiter = trio.CapacityLimiter(4)
        self._locks: dict[str, trio.Lock] = {}
        self._errors: dict[str, str] = {}  # dataset -> last refresh error (shown in status)
        self._last_refresh: dict[str, float] = {}

    def unmap_snapshots(self) -> int:
        """Unmap the pages of every served snapshot (Snapshot.unmap_pages; blocking, run it in
        a thread); the bytes advised. A snapshot closed meanwhile (a refresh swapped it) or an
        madvise refused is skipped with a log line: this only trims memory, it must never stop
        the housekeeping loop."""
        advised = 0
        for dataset in self._fs.datasets():
            try:
                advised += dataset.snapshot.unmap_pages()
            except (SnapshotError, OSError) as err:
                log.warning("dataset %r: snapshot pages not unmapped: %s", dataset.name, err)
        return advised

    # --- at start and at exit (blocking: before serving, after) ------------------------------

    def open_registered(self) -> None:
        """Serve every registered dataset from its snapshot; one that cannot be opened is
        shown in status with its error. Snapshot directories no dataset uses (left by a crash
        mid-build or mid-refresh) are deleted."""
        os.makedirs(self._snapshot_root, exist_ok=True)
        for spec in self._registry.list():
            try:
                self._mount_existing(spec)
            except CachefsError as exc:
                self._errors[spec.name] = str(exc)
                log.error("dataset %r not served: %s", spec.name, exc)
        in_use = {spec.extra.get("snapshot") for spec in self._registry.list()}
        for entry in os.scandir(self._snapshot_root):
            if entry.name not in in_use:
                shutil.rmtree(entry.path, ignore_errors=True)

    def close(self) -> None:
        for dataset in self._fs.datasets():
            dataset.snapshot.close()
            dataset.source.store.close()

    def _mount_existing(self, spec: DatasetSpec) -> None:
        snapshot_dir = os.path.join(self._snapshot_root, spec.extra.get("snapshot", ""))
        snapshot = Snapshot.open(snapshot_dir)
        source = self._open_source(spec)
        if not snapshot.records_owners and parse_uri(spec.uri).scheme == "file":
            try:
                snapshot = self._rebuild_with_owners(spec, source, snapshot)
            except BaseException:
                source.store.close()
                raise  # not served (shown in status) rather than served to everyone
        self._fs.add_dataset(MountedDataset(spec.name, spec.slot, snapshot, source))

    def _rebuild_with_owners(
        self, spec: DatasetSpec, source: DataSource, old: Snapshot
    ) -> Snapshot:
        """A file:// snapshot written before cachefs kept the source's modes and owners would
        show every file to everyone: list the directory again before serving it (at start,
        before the mount; same inodes). Snapshots of object stores need no rebuild: they
        record no owners either way."""
        dirname = f"{spec.name}-{secrets.token_hex(4)}"
        try:
            build_snapshot(
                source.store.list(), os.path.join(self._snapshot_root, dirname), previous=old
            )
        finally:
            old.close()
        spec.extra["snapshot"] = dirname
        self._registry.update(spec)  # the old directory is now an orphan, removed at start
        log.info("dataset %r: snapshot rebuilt to keep the source's modes and owners", spec.name)
        return Snapshot.open(os.path.join(self._snapshot_root, dirname))

    # --- the control API's calls (a single node) ---------------------------------------------

    def _refuse_in_cluster(self) -> None:
        if self._coordinator:
            raise ConfigError(
                f"this worker follows the coordinator at {self._coordinator}: manage "
                "datasets there (cachefs --coordinator URL dataset …)"
            )

    async def add_dataset(self, spec: DatasetSpec, *, allow_empty: bool = False) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._add(spec, allow_empty=allow_empty)

    async def remove_dataset(self, name: str, *, keep_cache: bool) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._remove(name, keep_cache=keep_cache)

    async def refresh_dataset(self, name: str) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._refresh(name)

    # --- the heartbeat agent's calls (a worker that follows a coordinator) -------------------

    def served_datasets(self) -> dict[str, int]:
        """Datasets served here → the refresh epoch their snapshot was built for."""
        return {
            spec.name: spec.extra.get("refresh_epoch", 0)
            for spec in self._registry.list()
            if self._fs.dataset(spec.name) is not None
        }

    async def add_followed_dataset(self, spec: DatasetSpec, refresh_epoch: int) -> None:
        if spec.name in {s.name for s in self._registry.list()}:  # registered, failed to open
            await self._remove(spec.name, keep_cache=True)
        spec.extra["refresh_epoch"] = refresh_epoch
        # The coordinator has accepted the dataset (an empty listing is refused before, by
        # `cachefs dataset add`): a source empty here is served empty, not refused again.
        await self._add(spec, allow_empty=True)

    async def remove_followed_dataset(self, name: str) -> None:
        await self._remove(name, keep_cache=False)

    async def refresh_followed_dataset(self, name: str, refresh_epoch: int) -> None:
        await self._refresh(name)
        spec = self._registry.get(name)
        spec.extra["refresh_epoch"] = refresh_epoch
        await self._blocking(self._registry.update, spec)

    # --- what the preloader, the filler and the cleanup tasks read ---------------------------

    def served_source_id(self, dataset: str) -> int | None:
        mounted = self._fs.dataset(dataset)
        return None if mounted is None else mounted.source.source_id

    def preload_source(self, dataset: str) -> PreloadSource | None:
        mounted = self._fs.dataset(dataset)
        if mounted is None:
            return None
        spec = self._registry.get(dataset)
        source = mounted.source
        return mounted.snapshot, store_config(spec), source.source_id, source.block_size

    async def prepare_reads(self, dataset: str, keys: Sequence[str]) -> int:
        """Prepare the native path's LOOKUP replies and block entries of files a preload or a
        fill dealt with (FileSystem.prepare_reads): at most :data:`PREPARED_FILES_MAX` files
        and :data:`PREPARED_BLOCKS_MAX` blocks, a batch at a time so that the FUSE requests
        in between wait for one batch at most. Only an optimisation: a failure is logged and
        ends it, never the preload or fill that asked; returns the files prepared."""
        return await prepare_in_batches(self._fs.prepare_reads, dataset, keys)

    # --- periodic refreshes (the worker's housekeeping) --------------------------------------

    async def refresh_due(self) -> None:
        """Refresh each dataset whose --refresh-every has passed since its last refresh."""
        now = time.time()
        for spec in self._registry.list():
            interval = spec.refresh_interval_s
            if interval and now - self._last_refresh.get(spec.name, self._started_at) >= interval:
                self._last_refresh[spec.name] = now
                try:
                    await self._refresh(spec.name)
                except CachefsError as exc:
                    log.error("scheduled refresh of %r failed: %s", spec.name, exc)

    # --- status ------------------------------------------------------------------------------

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self.describe(spec) for spec in self._registry.list()]

    def describe(self, spec: DatasetSpec) -> dict[str, Any]:
        """A dataset in `cachefs status` and `dataset ls`: its spec, state, snapshot and what
        is cached of it."""
        dataset = self._fs.dataset(spec.name)
        status: dict[str, Any] = {
            "name": spec.name,
            "uri": spec.uri,
            "endpoint": spec.endpoint,
            "block_size": spec.block_size,
            "timeout_s": spec.timeout_s,
            "first_byte_timeout_s": spec.first_byte_timeout_s,
            "generation": spec.generation,
            "state": "ready" if dataset is not None else "error",
            "error": self._errors.get(spec.name),
        }
        if dataset is not None:
            stats = dataset.snapshot.stats
            cached = self._cache.cached_bytes(dataset.source.source_id)
            status.update(
                files=stats.files,
                dirs=stats.dirs,
                bytes=stats.bytes,
                cached_bytes=cached,
                cached_fraction=cached / stats.bytes if stats.bytes else 1.0,
                skipped=dict(stats.skipped),
                skipped_total=sum(stats.skipped.values()),
                skipped_samples=list(stats.skipped_samples),
                snapshot_built_at=stats.built_at,
                snapshot_build_seconds=stats.build_seconds,
            )
        return status

    # --- the changes -------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an admin-path blocking call (store client setup, LMDB writes with fsync, snapshot
        opens, directory removal) in a thread, so the FUSE loop never waits on it."""
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self._admin_limiter)

    def _remove_snapshot_dir(self, dirname: str | None) -> None:
        if dirname:
            shutil.rmtree(os.path.join(self._snapshot_root, dirname), ignore_errors=True)

    def _lock_for(self, name: str) -> trio.Lock:
        return self._locks.setdefault(name, trio.Lock())

    def _open_source(self, spec: DatasetSpec) -> DataSource:
        store = open_store(store_config(spec))
        store.prepare_reads()  # the first read of the dataset does not wait for it
        return DataSource(spec.name, store, source_id_of(spec.uri, spec.endpoint), spec.block_size)

    async def _build(
        self, spec: DatasetSpec, source: DataSource, previous: Snapshot | None
    ) -> tuple[str, BuildResult]:
        """List the store into a new snapshot directory (in a thread). Returns (dirname, result)."""
        dirname = f"{spec.name}-{secrets.token_hex(4)}"
        dest = os.path.join(self._snapshot_root, dirname)
        began = time.perf_counter()
        try:
            result: BuildResult = await trio.to_thread.run_sync(
                lambda: build_snapshot(source.store.list(), dest, previous=previous),
                limiter=self._build_limiter,
            )
        except BaseException as exc:
            self._metrics.store_request("list", type(exc).__name__, time.perf_counter() - began)
            shutil.rmtree(dest, ignore_errors=True)
            raise
        self._metrics.store_request("list", "ok", time.perf_counter() - began)
        return dirname, result

    async def _add(self, spec: DatasetSpec, *, allow_empty: bool) -> dict[str, Any]:
        async with self._lock_for(spec.name):
            if self._fs.dataset(spec.name) is not None:
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            source = await self._blocking(self._open_source, spec)
            try:
                dirname, result = await self._build(spec, source, previous=None)
            except BaseException:
                source.store.close()
                raise
            if result.stats.files == 0 and not allow_empty:  # a mistyped prefix: add nothing
                await self._blocking(self._remove_snapshot_dir, dirname)
                source.store.close()
                raise EmptySource(spec.name, spec.uri, result.stats.skipped)
            spec.extra["snapshot"] = dirname
            spec.generation = 1
            try:
                spec = await self._blocking(self._registry.add, spec)
            except BaseException:
                shutil.rmtree(os.path.join(self._snapshot_root, dirname), ignore_errors=True)
                source.store.close()
                raise
            snapshot = await self._blocking(
                Snapshot.open, os.path.join(self._snapshot_root, dirname)
            )
            self._fs.add_dataset(MountedDataset(spec.name, spec.slot, snapshot, source))
            self._errors.pop(spec.name, None)
            self._last_refresh[spec.name] = time.time()
            await self._kernel.forget_inode(MOUNT_ROOT)
            log.info(
                "dataset %r added: %d files, %d bytes",
                spec.name,
                result.stats.files,
                result.stats.bytes,
            )
            return self.describe(spec)

    async def _remove(self, name: str, *, keep_cache: bool) -> dict[str, Any]:
        async with self._lock_for(name):
            spec = self._registry.get(name)
            dataset = self._fs.remove_dataset(name)
            await self._kernel.forget_entry(MOUNT_ROOT, name.encode())
            # The root's listing too: the kernel may keep it, and the entry invalidation above
            # reaches it only while the dataset's dentry is still in the kernel's cache.
            await self._kernel.forget_inode(MOUNT_ROOT)
            await self._blocking(self._registry.remove, name)
            self._errors.pop(name, None)
            freed = 0
            if dataset is not None:
                if not keep_cache:
                    freed = await trio.to_thread.run_sync(
                        self._cache.evict_source, dataset.source.source_id
                    )
                dataset.snapshot.close()
                dataset.source.store.close()
            await self._blocking(self._remove_snapshot_dir, spec.extra.get("snapshot"))
            return {"name": name, "removed": True, "freed_bytes": freed}

    async def _refresh(self, name: str) -> dict[str, Any]:
        async with self._lock_for(name):
            spec = self._registry.get(name)
            dataset = self._fs.dataset(name)
            if dataset is None:  # failed to open at start: rebuild from scratch
                source = await self._blocking(self._open_source, spec)
                previous = None
            else:
                source, previous = dataset.source, dataset.snapshot
            try:
                dirname, result = await self._build(spec, source, previous)
            except CachefsError as exc:
                self._errors[name] = str(exc)
                raise
            new_snapshot = await self._blocking(
                Snapshot.open, os.path.join(self._snapshot_root, dirname)
            )
            old_dir = spec.extra.get("snapshot")
            spec.extra["snapshot"] = dirname
            spec.generation += 1
            await self._blocking(self._registry.update, spec)
            if dataset is None:
                self._fs.add_dataset(MountedDataset(name, spec.slot, new_snapshot, source))
                await self._kernel.forget_inode(MOUNT_ROOT)  # the root's listing gains it
            else:
                retired = await self._blocking(
                    _retired_files, previous, result.removed + result.replaced
                )
                old_snapshot = self._fs.replace_snapshot(name, new_snapshot, source, retired)
                try:
                    await self._forget_changes(dataset, old_snapshot, result)
                finally:
                    old_snapshot.close()
            await self._blocking(self._remove_snapshot_dir, old_dir)
            self._errors.pop(name, None)
            self._last_refresh[name] = time.time()
            status = self.describe(spec)
            status["changed"] = len(result.changed_inos) + len(result.replaced)
            status["removed"] = len(result.removed)
            return status

    async def _forget_changes(
        self, dataset: MountedDataset, old: Snapshot, result: BuildResult
    ) -> None:
        """Make the kernel forget what changed, so a refreshed file never shows old bytes and a
        listing the kernel keeps (pyfuse3.cache_listings) never shows old entries."""
        ino_of = partial(self._fs.global_ino, dataset)
        if result.overflow or await self._blocking(_removes_a_directory, old, result.removed):
            # The changed listings cannot be named (too many changes), or a directory went
            # away, and with it the listings of everything below it, which a process whose
            # working directory is in there could still read: every directory of the old and
            # the new snapshot forgets its listing (one thread call; ENOENT: not cached).
            inos = await self._blocking(_every_dir, old, dataset.snapshot)
            await self._kernel.forget_inodes([ino_of(ino) for ino in inos])
        if result.overflow:  # too many to list: drop the whole dataset's dentry subtree
            await self._kernel.forget_entry(MOUNT_ROOT, dataset.name.encode())
            return
        for local_ino in result.changed_inos:
            await self._kernel.forget_inode(ino_of(local_ino))
        for parent_local, name in result.removed + result.replaced:
            await self._kernel.forget_entry(ino_of(parent_local), name)
        for dir_local in result.listings_changed:  # the kernel may keep listings
            await self._kernel.forget_inode(ino_of(dir_local))


def _removes_a_directory(old: Snapshot, removed: list[tuple[int, bytes]]) -> bool:
    """Whether any of a refresh's removed entries was a directory in the old snapshot."""
    for parent, name in removed:
        entry = old.lookup(parent, name)
        if entry is not None and entry.is_dir:
            return True
    return False


def _retired_files(old: Snapshot, removed: list[tuple[int, bytes]]) -> list[Entry]:
    """The old entries of the files among a refresh's removed entries (gone, or replaced by new
    bytes under a new inode): a process holding one open goes on reading it."""
    entries = (old.lookup(parent, name) for parent, name in removed)
    return [entry for entry in entries if entry is not None and not entry.is_dir]


def _every_dir(old: Snapshot, new: Snapshot) -> list[int]:
    return sorted(set(old.dir_inos()) | set(new.dir_inos()))
