"""The per-node worker: one trio nursery running the FUSE mount, the control API, the metrics
endpoint and housekeeping; in cluster mode (`cachefs worker`) also the peer block server, the
heartbeat agent, the preloader, the filler and the cleanup task runner. `cachefs up` runs it
alone in the foreground.

Lifecycle: take the state-directory lock → open the cache index and registry → open each
dataset's snapshot → mount → serve until SIGINT/SIGTERM or `cachefs down` → unmount cleanly →
flush the cache index (so the next start is warm).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from cachefs import __version__
from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockFile, BlockKey, source_id_of
from cachefs.client import CoordinatorClient
from cachefs.cluster.agent import ClusterAgent
from cachefs.cluster.fetchers import FetcherPool
from cachefs.cluster.fill import Filler
from cachefs.cluster.local_preload import LocalPreloads
from cachefs.cluster.membership import Membership
from cachefs.cluster.preload import Preloader
from cachefs.cluster.tasks import TaskRunner
from cachefs.control import WorkerAPI, create_control_app, create_metrics_app
from cachefs.errors import (
    CachefsError,
    ConfigError,
    DatasetExists,
    DatasetNotFound,
    EmptySource,
    PathNotFound,
)
from cachefs.fs import fuse_ops
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion, ReadLimits
from cachefs.fs.core import MOUNT_ROOT, SLOT_SHIFT, FileSystem, MountedDataset
from cachefs.fs.native_reads import NativeReads
from cachefs.host import TierRequest, check_tier_sizes, warn_if_short
from cachefs.meta import BuildResult, Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics, counter, gauge, labelled_counter, make_registry
from cachefs.mountpoint import forget_mount, prepare_mountpoint, remember_mount
from cachefs.peer.client import PeerClient
from cachefs.peer.server import PeerServer
from cachefs.pidlock import WORKER_LOCK_NAME, LockHeld, take_pid_lock
from cachefs.protocol import DatasetSpec
from cachefs.registry import Registry
from cachefs.settings import WorkerConfig
from cachefs.store import StoreConfig, open_store
from cachefs.store.base import RetryPolicy
from cachefs.store.uri import parse_uri

log = logging.getLogger("cachefs.worker")

#: Paths one batch-resolve or prefetch request may name (clients send batches of this or less).
MAX_PATHS_PER_REQUEST = 10_000
# Paths resolved between two trio checkpoints: a batch of thousands must not hold up FUSE.
_RESOLVE_SLICE = 256
# The longest path a unix socket can be bound to (sun_path holds 108 bytes with its NUL).
_MAX_UNIX_PATH = 107


class Worker(WorkerAPI):
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.metrics = WorkerMetrics()
        self.started_at = time.time()
        self._shutdown = trio.Event()
        self._build_limiter = trio.CapacityLimiter(2)
        self._admin_limiter = trio.CapacityLimiter(4)
        self._dataset_locks: dict[str, trio.Lock] = {}
        self._errors: dict[str, str] = {}  # dataset -> last refresh error (shown in status)
        self._last_refresh: dict[str, float] = {}
        self._metrics_registry = make_registry(self.metrics, self._gauges)
        self.mounted = False
        self.no_open = False
        self.cache: TieredBlockCache | None = None
        self.registry: Registry | None = None
        self.fs: FileSystem | None = None
        self.membership: Membership | None = None
        self.peers: PeerClient | None = None
        self.peer_server: PeerServer | None = None
        self.agent: ClusterAgent | None = None
        self.preloader: Preloader | None = None
        self._local_preloads: LocalPreloads | None = None  # single node: preload jobs run here
        self.filler: Filler | None = None
        self.tasks: TaskRunner | None = None
        self._fetchers: FetcherPool | None = None
        self.prefetcher: Prefetcher | None = None
        self._refresh_epochs: dict[str, int] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start, serve until shut down, stop. Whatever can be refused is checked before
        anything is created, and each refusal is one line (ConfigError); a start that fails
        later leaves nothing behind either: nothing mounted, no listener, and no tier directory
        that it created."""
        cfg = self.config
        self._check_config()
        lock_file = self._take_lock()
        new_dirs = [tier.path for tier in self._tier_configs() if not os.path.exists(tier.path)]
        status = _StartStatus(task_status)
        listeners: dict[str, socket.socket] = {}
        try:
            listeners = self._bind_listeners()
            mount_path = await prepare_mountpoint(cfg.mountpoint, cfg.state_dir)
            try:
                try:
                    self._open_state()
                except OSError as exc:  # a tier or state path that cannot be used
                    what = exc.filename or "the worker's state"
                    raise ConfigError(f"cannot open {what}: {exc.strerror}") from None
                await self._serve(mount_path, listeners, status)
            finally:
                self._close_state()  # what was opened, also after a failed open
        except BaseException:
            if not status.done:
                for path in new_dirs:
                    shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            for sock in listeners.values():
                sock.close()  # those not handed to a server yet
            lock_file.close()

    def _check_config(self) -> None:
        """What can be refused before anything is created."""
        cfg = self.config
        if cfg.fast_read:
            fuse_ops.check_fast_read_possible(cfg.no_open)
        if cfg.coordinator and (not cfg.listen or not cfg.token):
            raise ConfigError("a worker that follows a coordinator needs --listen and a token")
        if cfg.coordinator and not _dialable(cfg.listen):
            # The coordinator hands this address to the other workers, which dial it for peer
            # reads (and refuses heartbeats naming an address nobody can dial).
            raise ConfigError(
                f"--listen {cfg.listen}: other workers dial this address for peer reads; give "
                "this node's own address and a port (e.g. --listen 10.0.0.5:7701), not 0.0.0.0"
            )
        if len(cfg.socket_path.encode()) > _MAX_UNIX_PATH:
            raise ConfigError(
                f"state directory {cfg.state_dir} is too long a path for its control socket "
                f"(at most {_MAX_UNIX_PATH - len('/worker.sock')} bytes): pass a shorter --state"
            )
        check_tier_sizes(self._tier_requests())

    def _tier_configs(self) -> list[TierConfig]:
        cfg = self.config
        tiers = [TierConfig("ram", cfg.ram_path, cfg.ram_capacity, cfg.ram_reserve)]
        if cfg.ssd and cfg.ssd.capacity > 0:
            tiers.append(TierConfig("ssd", cfg.ssd.path, cfg.ssd.capacity, cfg.ssd_reserve))
        return tiers

    def _tier_requests(self) -> list[TierRequest]:
        return [
            TierRequest(f"--{tier.name}", tier.path, tier.capacity, in_memory=tier.name == "ram")
            for tier in self._tier_configs()
        ]

    def _bind_listeners(self) -> dict[str, socket.socket]:
        """The TCP addresses, bound before anything is mounted or created: a port that is
        taken is a one-line refusal with nothing to undo."""
        cfg = self.config
        wanted = {"metrics": ("--metrics", cfg.metrics_listen)}
        if cfg.coordinator:
            wanted["peer"] = ("--listen", cfg.listen)
        listeners: dict[str, socket.socket] = {}
        try:
            for name, (option, address) in wanted.items():
                if address:
                    listeners[name] = bind_tcp(address, option)
        except BaseException:
            for sock in listeners.values():
                sock.close()
            raise
        return listeners

    def _take_lock(self):
        """Create the state directory if needed and take its lock (one worker per directory)."""
        state_dir = self.config.state_dir
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            return take_pid_lock(os.path.join(state_dir, WORKER_LOCK_NAME))
        except LockHeld as held:
            raise ConfigError(
                f"another cachefs worker (pid {held.holder}) is using state directory "
                f"{state_dir}; stop it with `cachefs down` or pass another --state"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot use state directory {state_dir}: {exc.strerror}") from None

    def _open_state(self) -> None:
        cfg = self.config
        self.cache = TieredBlockCache(
            os.path.join(cfg.state_dir, "cache-index"),
            self._tier_configs(),
            admission=cfg.admission,
            promote=cfg.promote,
        )
        held = {usage.path: usage.used for usage in self.cache.usage()}
        for request in self._tier_requests():
            warn_if_short(request, held.get(request.path, 0))
        self.registry = Registry(os.path.join(cfg.state_dir, "registry"))
        if cfg.coordinator:
            self.membership = Membership(cfg.node)
        self.fs = FileSystem(
            BlockReader(self.cache, self.metrics, ReadLimits(store_threads=cfg.store_threads)),
            cfg.permissions,
        )
        self.prefetcher = Prefetcher(
            self.fs,
            self.cache,
            evicts=cfg.admission != "avoid-eviction",
            max_queued=cfg.prefetch_queue_files,
            concurrency=cfg.prefetch_concurrency,
        )
        os.makedirs(self._snapshot_root, exist_ok=True)
        for spec in self.registry.list():
            try:
                self._mount_existing(spec)
            except CachefsError as exc:
                self._errors[spec.name] = str(exc)
                log.error("dataset %r not served: %s", spec.name, exc)
        self._remove_orphan_snapshots()

    def _close_state(self) -> None:
        if self._fetchers is not None:
            self._fetchers.close()
        if self.fs is not None:
            for dataset in self.fs.datasets():
                dataset.snapshot.close()
                dataset.source.store.close()
        if self.cache is not None:
            self.cache.close()
        if self.registry is not None:
            self.registry.close()

    async def _serve(
        self, mount_path: str, listeners: dict[str, socket.socket], task_status
    ) -> None:
        """``mount_path``: the mountpoint, resolved before it becomes a FUSE mount (a stat of
        it later would wait on our own FUSE loop)."""
        cfg = self.config
        ops = fuse_ops.FuseOperations(
            self.fs,
            self.metrics,
            entry_timeout=cfg.entry_timeout,
            attr_timeout=cfg.attr_timeout,
            no_open=cfg.no_open,
        )
        self.no_open = ops.no_open
        table = fuse_ops.native_read_table(cfg.fast_read, ops.no_open)
        if table is not None:
            self.fs.native = NativeReads(table, self.cache, self.fs.reader)
            ops.use_native_table(table)
            self.metrics.native_reads = self.fs.native.stats
        try:
            fuse_ops.mount(
                ops,
                cfg.mountpoint,
                fuse_ops.mount_options(allow_other=cfg.allow_other),
            )
        except RuntimeError as exc:  # pyfuse3's only word for it; libfuse logs the reason
            raise ConfigError(f"cannot mount {cfg.mountpoint}: {exc}") from None
        self.mounted = True
        log.info("mounted %s (state %s)", cfg.mountpoint, cfg.state_dir)
        try:
            remember_mount(cfg.state_dir, mount_path)  # for the next start, should we be killed
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_fuse)
                if os.path.exists(cfg.socket_path):
                    os.unlink(cfg.socket_path)  # left by a killed worker; we hold the lock
                await nursery.start(
                    self._serve_http, create_control_app(self), f"unix:{cfg.socket_path}", "control"
                )
                os.chmod(cfg.socket_path, 0o600)
                if "metrics" in listeners:
                    await nursery.start(
                        self._serve_http,
                        create_metrics_app(self),
                        listeners.pop("metrics"),
                        "metrics",
                    )
                # The servers and FUSE loop above end on their own once shutdown is set
                # (hypercorn finishes in-flight requests, e.g. the reply to /v1/shutdown); the
                # background tasks below never end by themselves, so they are cancelled.
                if cfg.readahead_kib:
                    # The kernel applies the INIT reply's readahead limit when the FUSE loop
                    # answers INIT (always the first request); a stat() served by the loop
                    # proves that happened, so our setting is not overwritten.
                    await trio.to_thread.run_sync(os.stat, mount_path)
                    set_readahead(mount_path, cfg.readahead_kib)
                async with trio.open_nursery() as background:
                    if cfg.coordinator:
                        await self._start_cluster(background, listeners.pop("peer"))
                    else:
                        self._local_preloads = await self._open_local_preloads()
                    background.start_soon(self._housekeeping)
                    await background.start(self.fs.reader.serve_readahead)
                    await background.start(self.prefetcher.run)
                    background.start_soon(self._watch_signals)
                    if self.agent is not None:
                        await background.start(self.preloader.run)
                        await background.start(self.filler.run)
                        await background.start(self.tasks.run)
                        await background.start(self.agent.run)
                    if self._local_preloads is not None:
                        await background.start(self._local_preloads.run)
                    task_status.started()
                    await self._shutdown.wait()
                    fuse_ops.terminate()
                    background.cancel_scope.cancel()
                nursery.cancel_scope.deadline = trio.current_time() + 10  # never hang on exit
        finally:
            fuse_ops.unmount()
            if self.fs.native is not None:
                self.metrics.native_reads = self.fs.native.stats().copy  # keep the last counts
                self.fs.native.close()
                self.fs.native = None
            forget_mount(cfg.state_dir)
            self.mounted = False
            log.info("unmounted %s", cfg.mountpoint)

    async def _start_cluster(self, nursery: trio.Nursery, peer_listener: socket.socket) -> None:
        """Cluster mode: the peer block server and the peer client the read path uses (both
        run in ``nursery``, cancelled at shutdown), the preloader, the filler, the task runner
        and the heartbeat agent (started by the caller)."""
        cfg = self.config
        self.peers = PeerClient(cfg.token, timeout_s=cfg.peer_timeout_s)
        await nursery.start(self.peers.run)
        self.fs.reader.peers = self.peers
        self.fs.reader.route = self.membership
        self.peer_server = PeerServer(self.fs.serve_peer_block, cfg.token)
        await nursery.start(self.peer_server.serve, peer_listener)
        self._fetchers = FetcherPool(cfg.preload_processes)
        self.preloader = Preloader(
            self,
            self.cache,
            self.membership,
            self._fetchers,
            concurrency=cfg.preload_concurrency,
            max_concurrency=cfg.preload_concurrency_max,
        )
        self.metrics.store_concurrency["preload"] = self.preloader.concurrency.report
        self.filler = Filler(
            self,
            self.cache,
            self.peers,
            self.membership,
            self.metrics,
            concurrency=cfg.fill_concurrency,
        )
        self.tasks = TaskRunner(self, self.cache, self.membership, self.metrics)
        self.agent = ClusterAgent(
            self,
            CoordinatorClient(cfg.coordinator, cfg.token, timeout=10.0),
            cfg.node,
            self.membership,
            self.preloader,
            self.filler,
            self.tasks,
            state_dir=cfg.state_dir,
            interval_s=cfg.heartbeat_interval_s,
        )

    async def _open_local_preloads(self) -> LocalPreloads:
        """Single node: the preload jobs a coordinator would keep run here, on the same
        Preloader and fetcher processes as a cluster worker's (cachefs/cluster/local_preload.py)."""
        cfg = self.config
        self._fetchers = FetcherPool(cfg.preload_processes)
        preloads = LocalPreloads(
            self,
            self.cache,
            self._fetchers,
            node=cfg.node,
            state_file=os.path.join(cfg.state_dir, "preloads.json"),
            concurrency=cfg.preload_concurrency,
            max_concurrency=cfg.preload_concurrency_max,
        )
        self.metrics.store_concurrency["preload"] = preloads.concurrency.report
        await self._blocking(preloads.load)
        return preloads

    def local_preloads(self) -> LocalPreloads:
        if self.config.coordinator:
            raise ConfigError(
                f"this worker follows the coordinator at {self.config.coordinator}: preload "
                "there (cachefs --coordinator URL preload …)"
            )
        if self._local_preloads is None:
            raise ConfigError("the worker is still starting: try again in a moment")
        return self._local_preloads

    async def _serve_http(self, app, bind: str | socket.socket, name: str, *, task_status) -> None:
        """Serve an ASGI app with hypercorn until shutdown, finishing in-flight requests.
        ``bind``: "unix:PATH", or a socket already bound (:func:`bind_tcp`), handed over."""
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve as hypercorn_serve

        if isinstance(bind, socket.socket):
            bind = f"fd://{bind.detach()}"  # hypercorn's socket owns the descriptor from now on
        config = HypercornConfig()
        config.bind = [bind]
        config.accesslog = None
        config.errorlog = logging.getLogger(f"cachefs.{name}")
        config.graceful_timeout = 1.0
        await hypercorn_serve(
            app, config, shutdown_trigger=self._shutdown.wait, task_status=task_status
        )

    async def _run_fuse(self) -> None:
        try:
            await fuse_ops.serve(self.config.max_tasks)
        finally:
            self._shutdown.set()  # if FUSE stops (e.g. `umount` from outside), stop the worker

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s, shutting down", signal.Signals(signum).name)
                self._shutdown.set()
                return

    async def _housekeeping(self) -> None:
        """Periodic index flush (LRU stamps, durability) and scheduled dataset refreshes."""
        while True:
            await trio.sleep(1.0)
            await trio.to_thread.run_sync(self.cache.flush)
            now = time.time()
            for spec in self.registry.list():
                interval = spec.refresh_interval_s
                if (
                    interval
                    and now - self._last_refresh.get(spec.name, self.started_at) >= interval
                ):
                    self._last_refresh[spec.name] = now
                    try:
                        await self._refresh_dataset(spec.name)
                    except CachefsError as exc:
                        log.error("scheduled refresh of %r failed: %s", spec.name, exc)

    def request_shutdown(self) -> None:
        self._shutdown.set()

    # --- datasets ----------------------------------------------------------------------------

    @property
    def _snapshot_root(self) -> str:
        return os.path.join(self.config.state_dir, "snapshots")

    async def _blocking(self, fn, *args):
        """Run an admin-path blocking call (store client setup, LMDB writes with fsync, snapshot
        opens, directory removal) in a thread, so the FUSE loop never waits on it."""
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self._admin_limiter)

    def _remove_snapshot_dir(self, dirname: str | None) -> None:
        if dirname:
            shutil.rmtree(os.path.join(self._snapshot_root, dirname), ignore_errors=True)

    def _lock_for(self, name: str) -> trio.Lock:
        return self._dataset_locks.setdefault(name, trio.Lock())

    @staticmethod
    def store_config(spec: DatasetSpec) -> StoreConfig:
        """How a dataset's store is opened: here, and by `cachefs dataset add` probing it."""
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

    def _open_source(self, spec: DatasetSpec) -> DataSource:
        store = open_store(self.store_config(spec))
        return DataSource(spec.name, store, source_id_of(spec.uri, spec.endpoint), spec.block_size)

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
        self.fs.add_dataset(MountedDataset(spec.name, spec.slot, snapshot, source))

    def _rebuild_with_owners(self, spec: DatasetSpec, source: DataSource, old: Snapshot):
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
        self.registry.update(spec)  # the old directory is now an orphan, removed at start
        log.info("dataset %r: snapshot rebuilt to keep the source's modes and owners", spec.name)
        return Snapshot.open(os.path.join(self._snapshot_root, dirname))

    def _remove_orphan_snapshots(self) -> None:
        """Snapshot dirs left by a crash mid-build or mid-refresh are deleted at start."""
        in_use = {spec.extra.get("snapshot") for spec in self.registry.list()}
        for entry in os.scandir(self._snapshot_root):
            if entry.name not in in_use:
                shutil.rmtree(entry.path, ignore_errors=True)

    async def _build(self, spec: DatasetSpec, source: DataSource, previous: Snapshot | None):
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
            self.metrics.store_request("list", type(exc).__name__, time.perf_counter() - began)
            shutil.rmtree(dest, ignore_errors=True)
            raise
        self.metrics.store_request("list", "ok", time.perf_counter() - began)
        return dirname, result

    def _refuse_in_cluster(self) -> None:
        if self.config.coordinator:
            raise ConfigError(
                f"this worker follows the coordinator at {self.config.coordinator}: manage "
                "datasets there (cachefs --coordinator URL dataset …)"
            )

    async def add_dataset(self, spec: DatasetSpec, *, allow_empty: bool = False) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._add_dataset(spec, allow_empty=allow_empty)

    async def _add_dataset(self, spec: DatasetSpec, *, allow_empty: bool) -> dict[str, Any]:
        async with self._lock_for(spec.name):
            if self.fs.dataset(spec.name) is not None:
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
                spec = await self._blocking(self.registry.add, spec)
            except BaseException:
                shutil.rmtree(os.path.join(self._snapshot_root, dirname), ignore_errors=True)
                source.store.close()
                raise
            snapshot = await self._blocking(
                Snapshot.open, os.path.join(self._snapshot_root, dirname)
            )
            self.fs.add_dataset(MountedDataset(spec.name, spec.slot, snapshot, source))
            self._errors.pop(spec.name, None)
            self._last_refresh[spec.name] = time.time()
            await self._invalidate(MOUNT_ROOT, None)
            log.info(
                "dataset %r added: %d files, %d bytes",
                spec.name,
                result.stats.files,
                result.stats.bytes,
            )
            return self._dataset_status(spec)

    async def remove_dataset(self, name: str, *, keep_cache: bool) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._remove_dataset(name, keep_cache=keep_cache)

    async def _remove_dataset(self, name: str, *, keep_cache: bool) -> dict[str, Any]:
        async with self._lock_for(name):
            spec = self.registry.get(name)
            dataset = self.fs.remove_dataset(name)
            await self._invalidate(MOUNT_ROOT, name.encode())
            # The root's listing too: the kernel may keep it, and the entry invalidation above
            # reaches it only while the dataset's dentry is still in the kernel's cache.
            await self._invalidate(MOUNT_ROOT, None)
            await self._blocking(self.registry.remove, name)
            self._errors.pop(name, None)
            freed = 0
            if dataset is not None:
                if not keep_cache:
                    freed = await trio.to_thread.run_sync(
                        self.cache.evict_source, dataset.source.source_id
                    )
                dataset.snapshot.close()
                dataset.source.store.close()
            await self._blocking(self._remove_snapshot_dir, spec.extra.get("snapshot"))
            return {"name": name, "removed": True, "freed_bytes": freed}

    async def refresh_dataset(self, name: str) -> dict[str, Any]:
        self._refuse_in_cluster()
        return await self._refresh_dataset(name)

    async def _refresh_dataset(self, name: str) -> dict[str, Any]:
        async with self._lock_for(name):
            spec = self.registry.get(name)
            dataset = self.fs.dataset(name)
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
            await self._blocking(self.registry.update, spec)
            if dataset is None:
                self.fs.add_dataset(MountedDataset(name, spec.slot, new_snapshot, source))
                await self._invalidate(MOUNT_ROOT, None)  # the root's listing gains it
            else:
                old_snapshot = self.fs.replace_snapshot(name, new_snapshot, source)
                try:
                    await self._invalidate_changes(dataset, old_snapshot, result)
                finally:
                    old_snapshot.close()
            await self._blocking(self._remove_snapshot_dir, old_dir)
            self._errors.pop(name, None)
            self._last_refresh[name] = time.time()
            status = self._dataset_status(spec)
            status["changed"] = len(result.changed_inos)
            status["removed"] = len(result.removed)
            return status

    async def _invalidate_changes(
        self, dataset: MountedDataset, old: Snapshot, result: BuildResult
    ) -> None:
        """Make the kernel forget what changed, so a refreshed file never shows old bytes and a
        listing the kernel keeps (pyfuse3.cache_listings) never shows old entries."""
        if result.overflow or await self._blocking(_removes_a_directory, old, result.removed):
            # The changed listings cannot be named (too many changes), or a directory went
            # away, and with it the listings of everything below it, which a process whose
            # working directory is in there could still read: every directory of the old and
            # the new snapshot forgets its listing (one thread call; ENOENT: not cached).
            inos = await self._blocking(_every_dir, old, dataset.snapshot)
            await self._invalidate_inodes([self.fs.global_ino(dataset, ino) for ino in inos])
        if result.overflow:  # too many to list: drop the whole dataset's dentry subtree
            await self._invalidate(MOUNT_ROOT, dataset.name.encode())
            return
        for local_ino in result.changed_inos:
            await self._invalidate(self.fs.global_ino(dataset, local_ino), None)
        for parent_local, name in result.removed:
            await self._invalidate(self.fs.global_ino(dataset, parent_local), name)
        for dir_local in result.listings_changed:  # the kernel may keep listings
            await self._invalidate(self.fs.global_ino(dataset, dir_local), None)

    async def _invalidate_inodes(self, inodes: list[int]) -> None:
        """invalidate_inode of each, in one thread call; those the kernel has not cached are
        skipped silently."""
        if not self.mounted or not inodes:
            return

        def invalidate_all() -> None:
            for ino in inodes:
                try:
                    fuse_ops.invalidate_inode(ino)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                        log.warning("kernel cache invalidation failed: %s", exc)

        await trio.to_thread.run_sync(invalidate_all)

    async def _invalidate(self, ino: int, name: bytes | None) -> None:
        if not self.mounted:
            return
        call = (
            partial(fuse_ops.invalidate_inode, ino)
            if name is None
            else partial(fuse_ops.invalidate_entry, ino, name)
        )
        try:
            await trio.to_thread.run_sync(call)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # not cached: nothing to forget
                log.warning("kernel cache invalidation failed: %s", exc)

    # --- cluster mode: what the agent and the preloader call --------------------------------

    def served_datasets(self) -> dict[str, int]:
        return {
            spec.name: spec.extra.get("refresh_epoch", 0)
            for spec in self.registry.list()
            if self.fs.dataset(spec.name) is not None
        }

    async def add_followed_dataset(self, spec: DatasetSpec, refresh_epoch: int) -> None:
        if spec.name in {s.name for s in self.registry.list()}:  # registered, failed to open
            await self._remove_dataset(spec.name, keep_cache=True)
        spec.extra["refresh_epoch"] = refresh_epoch
        # The coordinator has accepted the dataset (an empty listing is refused before, by
        # `cachefs dataset add`): a source empty here is served empty, not refused again.
        await self._add_dataset(spec, allow_empty=True)

    async def remove_followed_dataset(self, name: str) -> None:
        await self._remove_dataset(name, keep_cache=False)

    async def refresh_followed_dataset(self, name: str, refresh_epoch: int) -> None:
        await self._refresh_dataset(name)
        spec = self.registry.get(name)
        spec.extra["refresh_epoch"] = refresh_epoch
        await self._blocking(self.registry.update, spec)

    def cluster_report(self) -> dict[str, Any]:
        """This node's heartbeat: peer address, tiers, and per dataset its size, the bytes
        cached here, in total and per shard (the coordinator's locality data), and when it was
        last read here (idle-copy cleanup). The agent adds preload, fill and task results."""
        last_read_at = self.fs.reader.last_read_at
        datasets = {}
        for dataset in self.fs.datasets():
            stats = dataset.snapshot.stats
            source_id = dataset.source.source_id
            datasets[dataset.name] = {
                "bytes": stats.bytes,
                "files": stats.files,
                "cached_bytes": self.cache.cached_bytes(source_id),
                "shards": {
                    str(shard): nbytes
                    for shard, nbytes in self.cache.cached_bytes_by_shard(source_id).items()
                },
                "last_read_at": last_read_at.get(dataset.name, 0.0),
            }
        return {
            "address": self.config.listen,
            "gpus": self.config.gpus,
            "tiers": [
                {"name": u.name, "capacity": u.capacity, "used": u.used} for u in self.cache.usage()
            ],
            "datasets": datasets,
            "activity": self.metrics.activity(),  # `cachefs stats --coordinator` shows it
        }

    def served_source_id(self, dataset: str) -> int | None:
        mounted = self.fs.dataset(dataset)
        return None if mounted is None else mounted.source.source_id

    def preload_source(self, dataset: str):
        mounted = self.fs.dataset(dataset)
        if mounted is None:
            return None
        spec = self.registry.get(dataset)
        source = mounted.source
        return mounted.snapshot, self.store_config(spec), source.source_id, source.block_size

    # --- read-side API -----------------------------------------------------------------------

    def list_datasets(self) -> list[dict[str, Any]]:
        return [self._dataset_status(spec) for spec in self.registry.list()]

    def _dataset_status(self, spec: DatasetSpec) -> dict[str, Any]:
        dataset = self.fs.dataset(spec.name)
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
            cached = self.cache.cached_bytes(dataset.source.source_id)
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

    def status(self) -> dict[str, Any]:
        m = self.metrics
        counters = self.cache.counters()
        return {
            "version": __version__,
            "node": self.config.node,
            "pid": os.getpid(),
            "mount": self.config.mountpoint,
            "mounted": self.mounted,
            "state_dir": self.config.state_dir,
            "uptime_s": time.time() - self.started_at,
            "admission": self.config.admission,
            "promote": self.config.promote,
            "fuse_no_open": self.no_open,
            # The native READ path's counters; None when every READ is served in Python.
            "fuse_fast_read": None if self.fs.native is None else self.fs.native.stats(),
            "tiers": [vars_of(usage) for usage in self.cache.usage()],
            "reads": {
                "hits": m.served_hits(),
                "misses": m.misses,
                "hit_ratio": m.hit_ratio(),
                "bytes_served": m.served_bytes(),
                "coalesced": m.fetch_coalesced,
                "readahead_blocks": m.readahead_blocks,
            },
            "prefetch": self.prefetcher.status(),
            "cache": vars_of(counters),
            "store": {
                "requests": {f"{op}:{outcome}": n for (op, outcome), n in m.store_requests.items()},
                "bytes": m.store_bytes,
                # The adaptive limits on GETs in flight, per purpose ("read", "preload").
                "concurrency": {
                    purpose: report() for purpose, report in m.store_concurrency.items()
                },
            },
            "peers": {
                "requests": dict(m.peer_requests),
                "blocks_served": m.peer_served,
            },
            "fill": {"blocks": dict(m.fill_blocks), "bytes": m.fill_bytes},
            "activity": m.activity(),  # what `cachefs stats` shows
            "cluster": self._cluster_status(),
            "cleanup": self._cleanup_status(),
            "open_files": self.fs.open_handles(),
            "datasets": self.list_datasets(),
            "rss_bytes": rss_bytes(),
        }

    def _cluster_status(self) -> dict[str, Any] | None:
        if self.agent is None:
            return None
        return {
            "coordinator": self.config.coordinator,
            "listen": self.config.listen,
            "connected": self.agent.connected,
            "error": self.agent.last_error,
            "preload": {
                "jobs": sorted(self.preloader.reports()),
                "fetched_blocks": self.preloader.fetched_blocks,
                "fetched_bytes": self.preloader.fetched_bytes,
                "failures": self.preloader.fetch_failures,
            },
            "fills": self.filler.reports(),
        }

    def _cleanup_status(self) -> dict[str, Any]:
        """Bytes freed by cleanup tasks per dataset and kind, and the last tasks run."""
        freed: dict[str, dict[str, int]] = {}
        for (dataset, kind), nbytes in sorted(self.metrics.freed_bytes.items()):
            freed.setdefault(dataset, {})[kind] = nbytes
        return {
            "freed_bytes": freed,
            "tasks": [] if self.tasks is None else list(self.tasks.history),
        }

    def resolve(self, dataset: str, path: str) -> dict[str, Any]:
        """Map a path to its blocks and, for blocks cached on this node, their files.

        A short-circuit reader reads those files directly (bypassing FUSE) and falls back to the
        mount for the rest. Block files are immutable once written, but a block can be evicted
        between this answer and the read: a reader that gets ENOENT must fall back to the mount.
        """
        mounted = self.fs.dataset(dataset)
        if mounted is None:
            raise DatasetNotFound(f"no dataset named {dataset!r}")
        entry = mounted.snapshot.resolve(path.strip("/"))
        if entry is None:
            raise PathNotFound(f"{path!r} not found in dataset {dataset!r}")
        if entry.is_dir:
            raise PathNotFound(f"{path!r} is a directory")
        block_size = mounted.source.block_size
        blocks = []
        for index in range((entry.size + block_size - 1) // block_size):
            key = BlockKey.make(mounted.source.source_id, entry.key, entry.etag, index)
            start = index * block_size
            cached = self.cache.block_file(key)
            blocks.append(
                {
                    "index": index,
                    "offset": start,
                    "length": min(block_size, entry.size - start),
                    "file": None if cached is None else cached.path,
                    "checksum": None if cached is None else _checksum_hex(cached),
                }
            )
        return {
            "dataset": dataset,
            "path": path,
            "size": entry.size,
            "etag": entry.etag,
            "inode": mounted.slot << SLOT_SHIFT | entry.ino,
            "block_size": block_size,
            "blocks": blocks,
            "mount_path": os.path.join(self.config.mountpoint, dataset, path.strip("/")),
        }

    async def resolve_many(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        """Batch resolve for short-circuit readers (tf_dataset): per path its size, etag and
        blocks, each block either ``[file, length, checksum]`` — cached on this node: the file,
        the length and the xxh3_64 (16 hex digits) it was admitted with, which the reader
        verifies before trusting the bytes — or None (not cached here: read it through the
        mount). A path that is missing or a directory gets ``"error"`` instead.

        Answers describe the snapshot current when each path was looked up: a refresh during
        the call can make later paths resolve against the new one, each file consistently."""
        if len(paths) > MAX_PATHS_PER_REQUEST:
            raise ConfigError(
                f"{len(paths)} paths in one resolve request; send at most "
                f"{MAX_PATHS_PER_REQUEST} per request"
            )
        files: list[dict[str, Any]] = []
        mounted = None
        for start in range(0, len(paths), _RESOLVE_SLICE):
            if start:
                await trio.sleep(0)  # let FUSE requests in between slices
            mounted = self.fs.dataset(dataset)  # again after each checkpoint: a refresh swaps it
            if mounted is None:
                raise DatasetNotFound(f"no dataset named {dataset!r}")
            source = mounted.source
            block_size = source.block_size
            batch = paths[start : start + _RESOLVE_SLICE]
            entries = mounted.snapshot.resolve_many([path.strip("/") for path in batch])
            for path, entry in zip(batch, entries, strict=True):
                if entry is None or entry.is_dir:
                    files.append({"path": path, "error": "not a file" if entry else "not found"})
                    continue
                blocks = []
                for index in range((entry.size + block_size - 1) // block_size):
                    key = BlockKey.make(source.source_id, entry.key, entry.etag, index)
                    cached = self.cache.block_file(key)
                    blocks.append(
                        None
                        if cached is None
                        else [cached.path, cached.size, _checksum_hex(cached)]
                    )
                files.append(
                    {"path": path, "size": entry.size, "etag": entry.etag, "blocks": blocks}
                )
        if mounted is None:  # no paths: still say whether the dataset exists
            mounted = self.fs.dataset(dataset)
            if mounted is None:
                raise DatasetNotFound(f"no dataset named {dataset!r}")
        return {
            "dataset": dataset,
            "mount_root": os.path.join(self.config.mountpoint, dataset),
            "block_size": mounted.source.block_size,
            # The snapshot the last paths were looked up in (a new name after every refresh;
            # the earlier paths of this answer were looked up in it or an older one): a reader
            # keeping layouts between epochs asks again when it changes.
            "snapshot": os.path.basename(mounted.snapshot.path),
            "files": files,
        }

    def prefetch(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        """Queue a prefetch hint: a same-node reader will read these files soon."""
        if self.fs.dataset(dataset) is None:
            raise DatasetNotFound(f"no dataset named {dataset!r}")
        if len(paths) > MAX_PATHS_PER_REQUEST:
            raise ConfigError(
                f"{len(paths)} paths in one prefetch hint; send at most "
                f"{MAX_PATHS_PER_REQUEST} per hint"
            )
        return self.prefetcher.hint(dataset, paths)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self._metrics_registry)

    def _gauges(self):
        if self.cache is None:
            return
        usage = self.cache.usage()
        yield gauge(
            "cachefs_tier_capacity_bytes",
            "Tier capacity",
            ["tier"],
            [([u.name], u.capacity) for u in usage],
        )
        yield gauge(
            "cachefs_tier_used_bytes",
            "Bytes cached in the tier",
            ["tier"],
            [([u.name], u.used) for u in usage],
        )
        yield gauge(
            "cachefs_tier_reserved_bytes",
            "Bytes held by the no-eviction reserve",
            ["tier"],
            [([u.name], u.reserved_used) for u in usage],
        )
        counters = self.cache.counters()
        yield counter("cachefs_admissions", "Blocks admitted to a tier", counters.admitted)
        yield counter(
            "cachefs_admissions_refused",
            "Admissions refused (full, avoid-eviction)",
            counters.refused,
        )
        yield counter("cachefs_evictions", "Blocks evicted by the lru policy", counters.evicted)
        yield counter(
            "cachefs_corrupt_blocks", "Blocks dropped for failing verification", counters.corrupt
        )
        if self.prefetcher is None:
            return
        hints = self.prefetcher.counters
        yield counter(
            "cachefs_prefetch_hinted_files", "Files named in prefetch hints", hints.hinted_files
        )
        yield counter(
            "cachefs_prefetch_dropped_files",
            "Hinted files dropped unprocessed (queue full, oldest first)",
            hints.dropped_files,
        )
        yield labelled_counter(
            "cachefs_prefetch_blocks",
            "Blocks of hinted files, by outcome",
            ["outcome"],
            [
                (["fetched"], hints.blocks_fetched),
                (["cached"], hints.blocks_cached),
                (["no_room"], hints.blocks_no_room),
                (["failed"], hints.blocks_failed),
            ],
        )
        yield gauge(
            "cachefs_prefetch_queued_files",
            "Hinted files waiting",
            [],
            [([], len(self.prefetcher))],
        )
        rows_cached, rows_fraction = [], []
        for dataset in self.fs.datasets():
            cached = self.cache.cached_bytes(dataset.source.source_id)
            total = dataset.snapshot.stats.bytes
            rows_cached.append(([dataset.name], cached))
            rows_fraction.append(([dataset.name], cached / total if total else 1.0))
        yield gauge(
            "cachefs_dataset_cached_bytes", "Cached bytes per dataset", ["dataset"], rows_cached
        )
        yield gauge(
            "cachefs_dataset_cached_fraction",
            "Cached fraction per dataset",
            ["dataset"],
            rows_fraction,
        )
        yield gauge("cachefs_worker_rss_bytes", "Worker resident memory", [], [([], rss_bytes())])


def _checksum_hex(block: BlockFile) -> str:
    # Hex, not a JSON number: 64-bit values lose precision in many JSON readers.
    return f"{block.checksum:016x}"


@dataclass
class PrefetchCounters:
    hinted_files: int = 0  # file paths received in hints
    dropped_files: int = 0  # dropped unprocessed because the queue was full (oldest first)
    unknown_files: int = 0  # not a file of the dataset when processed
    blocks_fetched: int = 0  # fetched into the cache (or from the owner, in a cluster)
    blocks_cached: int = 0  # already cached here: nothing to do
    blocks_no_room: int = 0  # skipped: the tiers are full and admission avoids eviction
    blocks_failed: int = 0  # the fetch failed (the reader's own read will retry it)


class Prefetcher:
    """Fetches the blocks of files a same-node reader says it will read soon (prefetch hints,
    sent by tf_dataset ahead of its pipeline), so that its reads find them cached.

    Hints wait in a queue of at most ``max_queued`` files; past that the *oldest* are dropped
    (and counted): a reader that hints ahead of itself makes its oldest hints the least useful
    ones, since it is reading those files now and its reads fetch them anyway. One task takes
    files in order and starts at most ``concurrency`` block fetches at once, each through
    ``BlockReader.fetch_ahead`` — the read path's own fetch: a FUSE read of a block being
    prefetched waits for that fetch instead of starting another, a cluster node gets the block
    from its shard's owner, and the store limiter is shared, of which prefetches hold at most
    ``concurrency`` slots so FUSE misses keep the rest. Nothing here ever blocks a FUSE read.
    """

    def __init__(
        self, fs: FileSystem, cache, *, evicts: bool, max_queued: int, concurrency: int
    ) -> None:
        self._fs = fs
        self._cache = cache
        self._evicts = evicts
        self._queue: deque[tuple[str, str]] = deque()
        self._max_queued = max_queued
        self._slots = trio.Semaphore(max(1, concurrency))
        self._hinted = trio.Event()
        self.counters = PrefetchCounters()

    def __len__(self) -> int:
        return len(self._queue)

    def hint(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        """Queue files (called on the trio loop by the control API; never waits)."""
        dropped = 0
        for path in paths:
            self._queue.append((dataset, path))
        overflow = len(self._queue) - self._max_queued
        for _ in range(max(0, overflow)):
            self._queue.popleft()
            dropped += 1
        self.counters.hinted_files += len(paths)
        self.counters.dropped_files += dropped
        if self._queue:
            self._hinted.set()
        # "dropped" counts hints of this request and older ones alike: whichever were oldest.
        accepted = min(len(paths), self._max_queued)
        return {"accepted": accepted, "dropped": dropped, "queued": len(self._queue)}

    def status(self) -> dict[str, Any]:
        return {**vars_of(self.counters), "queued_files": len(self._queue)}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Process hints until cancelled (the worker starts this in its background nursery)."""
        async with trio.open_nursery() as fetches:
            task_status.started()
            while True:
                if not self._queue:
                    self._hinted = trio.Event()
                    await self._hinted.wait()
                    continue
                dataset, path = self._queue.popleft()
                try:
                    await self._prefetch_file(fetches, dataset, path)
                except CachefsError as exc:  # e.g. the dataset went away: a hint never fails us
                    self.counters.unknown_files += 1
                    log.debug("prefetch of %s/%s skipped: %s", dataset, path, exc)

    async def _prefetch_file(self, fetches: trio.Nursery, dataset: str, path: str) -> None:
        mounted = self._fs.dataset(dataset)
        entry = None if mounted is None else mounted.snapshot.resolve(path.strip("/"))
        if entry is None or entry.is_dir:
            self.counters.unknown_files += 1
            return
        source = mounted.source  # kept: the fetches finish against the version hinted
        file = FileVersion(entry.key, entry.etag, entry.size)
        block_size = source.block_size
        for index in range((entry.size + block_size - 1) // block_size):
            key = BlockKey.make(source.source_id, entry.key, entry.etag, index)
            if self._cache.locate(key) is not None:
                self.counters.blocks_cached += 1
                continue
            length = min(block_size, entry.size - index * block_size)
            if not self._room_for(source, key, length):
                self.counters.blocks_no_room += 1
                continue
            await self._slots.acquire()  # the queue waits here, never a FUSE read
            fetches.start_soon(self._fetch_block, source, file, index)

    def _room_for(self, source: DataSource, key: BlockKey, length: int) -> bool:
        """Whether fetching the block can leave it cached: not when this node would admit it
        but its tiers are full and the policy avoids eviction (the block would be read through
        and forgotten: a store GET for nothing)."""
        route = self._fs.reader.route
        if route is not None and route.owner_address(source.dataset, key.shard) is not None:
            return True  # another node owns it: fetching it makes that node cache it
        if self._evicts:
            return True
        return any(tier.capacity - tier.used >= length for tier in self._cache.usage())

    async def _fetch_block(self, source: DataSource, file: FileVersion, index: int) -> None:
        try:
            where = await self._fs.reader.fetch_ahead(source, file, index)
        except CachefsError as exc:
            self.counters.blocks_failed += 1
            log.debug("prefetch of block %d of %s failed: %s", index, file.key, exc)
        else:
            if where is None:  # a read cached it while this fetch waited for a slot
                self.counters.blocks_cached += 1
            else:
                self.counters.blocks_fetched += 1
        finally:
            self._slots.release()


def vars_of(obj) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


def _dialable(address: str) -> bool:
    """Whether another machine can dial ``address`` ("HOST:PORT"): a named or specific host
    (not 0.0.0.0, ::, or empty) and a port in 1..65535."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return False
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host != "0"  # a host name ("0" reads as 0.0.0.0 to inet_aton)


def bind_tcp(address: str, option: str) -> socket.socket:
    """A TCP socket bound to ``address`` ("HOST:PORT"; listened on by hypercorn), or a one-line
    ConfigError naming ``option``."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{option} wants HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As hypercorn sets them on the sockets it binds itself.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {address} ({option}): {reason}") from None
    return sock


class _StartStatus:
    """trio's task_status, remembering whether the start completed."""

    def __init__(self, task_status) -> None:
        self._task_status = task_status
        self.done = False

    def started(self, value=None) -> None:
        self.done = True
        self._task_status.started(value)


async def run_worker(config: WorkerConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await Worker(config).run(task_status=task_status)


def _removes_a_directory(old: Snapshot, removed: list[tuple[int, bytes]]) -> bool:
    """Whether any of a refresh's removed entries was a directory in the old snapshot."""
    for parent, name in removed:
        entry = old.lookup(parent, name)
        if entry is not None and entry.is_dir:
            return True
    return False


def _every_dir(old: Snapshot, new: Snapshot) -> list[int]:
    return sorted(set(old.dir_inos()) | set(new.dir_inos()))
