"""The per-node worker's lifecycle: one trio nursery running the FUSE mount, the control API, the
metrics endpoint and housekeeping; in cluster mode (`cachefs worker`) also the peer block
server, the heartbeat agent, the preloader, the filler and the cleanup task runner. `cachefs up`
runs it alone in the foreground.

Lifecycle: refuse what cannot work (before anything is created) → take the state-directory
lock → bind the TCP listeners → prepare the mountpoint → open the state and build the parts
(cachefs/node.py) → mount → serve until SIGINT/SIGTERM or `cachefs down` → unmount cleanly →
close (the cache index flushed, so the next start is warm).

Where the parts live: settings cachefs/settings.py; the parts, built together cachefs/node.py;
datasets cachefs/datasets.py; status and metrics cachefs/status.py; listeners
cachefs/listeners.py; the FUSE mount cachefs/fs/mount.py; short-circuit resolve
cachefs/fs/short_circuit.py; prefetch hints cachefs/fs/prefetch.py.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import socket
import time
from typing import IO

import trio

from cachefs.control import create_control_app, create_metrics_app
from cachefs.errors import ConfigError
from cachefs.fs import fuse_ops
from cachefs.host import check_tier_sizes, raise_open_file_limit
from cachefs.listeners import bind_listeners, dialable, serve_http
from cachefs.metrics import WorkerMetrics
from cachefs.mountpoint import forget_mount, prepare_mountpoint, remember_mount
from cachefs.node import Node, tier_configs, tier_requests
from cachefs.pidlock import WORKER_LOCK_NAME, LockHeld, take_pid_lock
from cachefs.settings import WorkerConfig
from cachefs.status import mapped_file_bytes, note_frozen

log = logging.getLogger("cachefs.worker")

# The longest path a unix socket can be bound to (sun_path holds 108 bytes with its NUL).
_MAX_UNIX_PATH = 107
# How long the servers may take to finish once shutdown is set: never hang on exit.
_EXIT_DEADLINE_S = 10
#: Mapped files the worker keeps before it unmaps its snapshots' pages (Snapshot.unmap_pages):
#: the libraries take ~16 MiB, and a walk of a large dataset would map its whole snapshot (216
#: MiB for 1.28 M entries). Above this, once a second, the snapshots are unmapped; what is read
#: again maps back from the page cache.
MAPPED_FILES_BYTES = 64 << 20


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.metrics = WorkerMetrics()
        self.started_at = time.time()
        self._shutdown = trio.Event()

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start, serve until shut down, stop. Whatever can be refused is checked before
        anything is created, and each refusal is one line (ConfigError); a start that fails
        later leaves nothing behind either: nothing mounted, no listener, and no tier directory
        that it created."""
        cfg = self.config
        self._check_config()
        raise_open_file_limit()  # before anything is opened: what is sized by it reads it after
        lock_file = self._take_lock()
        new_dirs = [tier.path for tier in tier_configs(cfg) if not os.path.exists(tier.path)]
        status = _StartStatus(task_status)
        listeners: dict[str, socket.socket] = {}
        try:
            listeners = bind_listeners(cfg)
            mount_path = await prepare_mountpoint(cfg.mountpoint, cfg.state_dir)
            node = self._open_node()
            try:
                await self._serve(node, mount_path, listeners, status)
            finally:
                node.close()
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
        if cfg.passthrough:
            fuse_ops.check_passthrough_possible(cfg.fast_read, cfg.no_open)
        following = cfg.cluster()  # refuses a coordinator without --listen and a token
        if following is not None and not dialable(following.listen):
            # The coordinator hands this address to the other workers, which dial it for peer
            # reads (and refuses heartbeats naming an address nobody can dial).
            raise ConfigError(
                f"--listen {following.listen}: other workers dial this address for peer reads; "
                "give this node's own address and a port (e.g. --listen 10.0.0.5:7701), not "
                "0.0.0.0"
            )
        if len(cfg.socket_path.encode()) > _MAX_UNIX_PATH:
            raise ConfigError(
                f"state directory {cfg.state_dir} is too long a path for its control socket "
                f"(at most {_MAX_UNIX_PATH - len('/worker.sock')} bytes): pass a shorter --state"
            )
        check_tier_sizes(tier_requests(cfg))

    def _take_lock(self) -> IO[str]:
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

    def _open_node(self) -> Node:
        try:
            return Node(
                self.config,
                self.metrics,
                started_at=self.started_at,
                request_shutdown=self.request_shutdown,
            )
        except OSError as exc:  # a tier or state path that cannot be used
            what = exc.filename or "the worker's state"
            raise ConfigError(f"cannot open {what}: {exc.strerror}") from None

    async def _serve(
        self,
        node: Node,
        mount_path: str,
        listeners: dict[str, socket.socket],
        task_status: _StartStatus,
    ) -> None:
        """``mount_path``: the mountpoint, resolved before it becomes a FUSE mount (a stat of
        it later would wait on our own FUSE loop)."""
        cfg = self.config
        mount = node.mount
        mount.mount()
        log.info("mounted %s (state %s)", cfg.mountpoint, cfg.state_dir)
        try:
            remember_mount(cfg.state_dir, mount_path)  # for the next start, should we be killed
            async with trio.open_nursery() as servers:
                servers.start_soon(self._run_fuse, node)
                if os.path.exists(cfg.socket_path):
                    os.unlink(cfg.socket_path)  # left by a killed worker; we hold the lock
                await servers.start(
                    serve_http,
                    create_control_app(node),
                    f"unix:{cfg.socket_path}",
                    "control",
                    self._shutdown.wait,
                )
                os.chmod(cfg.socket_path, 0o600)
                if "metrics" in listeners:
                    await servers.start(
                        serve_http,
                        create_metrics_app(node),
                        listeners.pop("metrics"),
                        "metrics",
                        self._shutdown.wait,
                    )
                # The servers and FUSE loop above end on their own once shutdown is set
                # (hypercorn finishes in-flight requests, e.g. the reply to /v1/shutdown); the
                # background tasks below never end by themselves, so they are cancelled.
                await mount.wait_for_init(mount_path)
                if cfg.readahead_kib:
                    mount.set_readahead(mount_path, cfg.readahead_kib)
                mount.say_passthrough()
                async with trio.open_nursery() as background:
                    background.start_soon(self._watch_signals)
                    await node.start(background, listeners.pop("peer", None))
                    background.start_soon(self._housekeeping, node)
                    tune_gc()
                    task_status.started()
                    await self._shutdown.wait()
                    mount.terminate()
                    background.cancel_scope.cancel()
                servers.cancel_scope.deadline = trio.current_time() + _EXIT_DEADLINE_S
        finally:
            mount.unmount()
            forget_mount(cfg.state_dir)
            log.info("unmounted %s", cfg.mountpoint)

    async def _run_fuse(self, node: Node) -> None:
        try:
            await node.mount.serve()
        finally:
            self._shutdown.set()  # if FUSE stops (e.g. `umount` from outside), stop the worker

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s, shutting down", signal.Signals(signum).name)
                self._shutdown.set()
                return

    async def _housekeeping(self, node: Node) -> None:
        """Periodic index flush (LRU stamps, durability), scheduled dataset refreshes, and
        snapshot pages unmapped once the mapped files pass MAPPED_FILES_BYTES."""
        while True:
            await trio.sleep(1.0)
            await trio.to_thread.run_sync(node.cache.flush)
            await node.datasets.refresh_due()
            if mapped_file_bytes() > MAPPED_FILES_BYTES:
                await trio.to_thread.run_sync(node.datasets.unmap_snapshots)


class _StartStatus:
    """trio's task_status, remembering whether the start completed."""

    def __init__(self, task_status: trio.TaskStatus[None]) -> None:
        self._task_status = task_status
        self.done = False

    def started(self) -> None:
        self.done = True
        self._task_status.started()


def tune_gc() -> None:
    """Keep the garbage collector's passes short: what is alive once the worker serves (the
    modules, the store clients' parsed service models, the snapshots: ~90,000 objects before
    any dataset, more with each store client) is frozen out of every later collection. The
    collector's older-generation passes traversed all of it again and again while requests
    allocated (bench/results/cluster/2026-12-02-gc.md). Young collections run as before (a
    larger threshold was tried: the collector's share fell a little further, but the rates
    did not show it and a young generation of 50,000 objects keeps more memory in flight), and
    reference counting frees everything else at once."""
    gc.freeze()
    note_frozen()  # counted once: counting walks every frozen object
