"""One worker's parts, built together once its state directory is locked, each given what it
depends on when it is built: the cache tiers and the registry; in a cluster the membership and
the peer client, so that the block reader is complete from the start (with no view of the
cluster yet, the membership routes every block to this node, as on a single node); the
filesystem and its FUSE mount, the datasets, the prefetcher, the short-circuit resolver; the
preload jobs of a single node, or the cluster's preloader, filler, cleanup tasks and heartbeat
agent; and what reports on them all (cachefs/status.py).

A :class:`Node` is the one object the control API (cachefs/control.py: :class:`WorkerAPI`) and
the heartbeat agent (:class:`~cachefs.cluster.agent.ClusterWorker`) talk to; the worker
(cachefs/worker.py) runs its lifecycle: mount, serve, stop, close.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.client import CoordinatorClient
from cachefs.cluster.agent import ClusterAgent
from cachefs.cluster.fetchers import FetcherPool
from cachefs.cluster.fill import Filler
from cachefs.cluster.local_preload import LocalPreloads
from cachefs.cluster.membership import Membership
from cachefs.cluster.preload import Preloader
from cachefs.cluster.tasks import TaskRunner
from cachefs.control import WorkerAPI
from cachefs.datasets import DatasetManager
from cachefs.errors import ConfigError, DatasetNotFound
from cachefs.fs.blocks import BlockReader, ReadLimits
from cachefs.fs.core import FileSystem
from cachefs.fs.mount import FuseMount
from cachefs.fs.prefetch import Prefetcher
from cachefs.fs.short_circuit import MAX_PATHS_PER_REQUEST, ShortCircuit
from cachefs.host import TierRequest, warn_if_short
from cachefs.metrics import WorkerMetrics
from cachefs.peer.client import PeerClient
from cachefs.peer.server import PeerServer
from cachefs.protocol import DatasetSpec
from cachefs.registry import Registry
from cachefs.settings import Following, WorkerConfig
from cachefs.status import WorkerStatus


def tier_configs(config: WorkerConfig) -> list[TierConfig]:
    tiers = [TierConfig("ram", config.ram_path, config.ram_capacity, config.ram_reserve)]
    if config.ssd and config.ssd.capacity > 0:
        tiers.append(TierConfig("ssd", config.ssd.path, config.ssd.capacity, config.ssd_reserve))
    return tiers


def tier_requests(config: WorkerConfig) -> list[TierRequest]:
    """The tiers as cachefs/host.py checks their sizes (before anything is created)."""
    return [
        TierRequest(f"--{tier.name}", tier.path, tier.capacity, in_memory=tier.name == "ram")
        for tier in tier_configs(config)
    ]


@dataclass(frozen=True)
class PeerRouting:
    """A cluster worker's view of who owns which shard, and its connections to the other
    workers: built before the block reader, which reads other nodes' shards through them."""

    following: Following
    membership: Membership
    peers: PeerClient


@dataclass
class ClusterParts:
    """What a worker that follows a coordinator adds to a single node's parts."""

    routing: PeerRouting
    peer_server: PeerServer  # this node's blocks, for the other workers
    preloader: Preloader
    filler: Filler
    tasks: TaskRunner
    agent: ClusterAgent


class Node(WorkerAPI):
    def __init__(
        self,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        *,
        started_at: float,
        request_shutdown: Callable[[], None],
    ) -> None:
        """Open the state and build every part (blocking: call before serving). If a part
        cannot be built, those built already are closed."""
        self.config = config
        self._request_shutdown = request_shutdown
        following = config.cluster()
        with ExitStack() as built:
            self.cache = TieredBlockCache(
                os.path.join(config.state_dir, "cache-index"),
                tier_configs(config),
                admission=config.admission,
                promote=config.promote,
            )
            built.callback(self.cache.close)
            held = {usage.path: usage.used for usage in self.cache.usage()}
            for request in tier_requests(config):
                warn_if_short(request, held.get(request.path, 0))
            self.registry = Registry(os.path.join(config.state_dir, "registry"))
            built.callback(self.registry.close)

            routing = None
            if following is not None:
                routing = PeerRouting(
                    following,
                    Membership(config.node),
                    PeerClient(following.token, timeout_s=config.peer_timeout_s),
                )
            reader = BlockReader(
                self.cache,
                metrics,
                ReadLimits(store_threads=config.store_threads),
                peers=None if routing is None else routing.peers,
                route=None if routing is None else routing.membership,
            )
            self.fs = FileSystem(reader, config.permissions)
            self.mount = FuseMount(
                self.fs,
                self.cache,
                metrics,
                mountpoint=config.mountpoint,
                allow_other=config.allow_other,
                entry_timeout=config.entry_timeout,
                attr_timeout=config.attr_timeout,
                no_open=config.no_open,
                fast_read=config.fast_read,
                passthrough=config.passthrough,
                max_tasks=config.max_tasks,
                fuse_processes=config.fuse_processes,
            )
            self.datasets = DatasetManager(
                self.fs,
                self.cache,
                self.registry,
                metrics,
                self.mount,
                state_dir=config.state_dir,
                coordinator=config.coordinator,
                started_at=started_at,
            )
            built.callback(self.datasets.close)
            self.datasets.open_registered()
            self.prefetcher = Prefetcher(
                self.fs,
                self.cache,
                evicts=config.admission != "avoid-eviction",
                max_queued=config.prefetch_queue_files,
                concurrency=config.prefetch_concurrency,
            )
            self.short_circuit = ShortCircuit(self.fs, self.cache, config.mountpoint)
            self.fetchers = FetcherPool(config.preload_processes)
            built.callback(self.fetchers.close)

            self.cluster: ClusterParts | None = None
            self._local_preloads: LocalPreloads | None = None  # a single node runs its preloads
            if routing is not None:
                self.cluster = self._cluster_parts(routing, metrics)
                preload_concurrency = self.cluster.preloader.concurrency
                preload_counters = self.cluster.preloader.counters
            else:
                self._local_preloads = LocalPreloads(
                    self.datasets,
                    self.cache,
                    self.fetchers,
                    node=config.node,
                    state_file=os.path.join(config.state_dir, "preloads.json"),
                    concurrency=config.preload_concurrency,
                    max_concurrency=config.preload_concurrency_max,
                )
                self._local_preloads.load()
                preload_concurrency = self._local_preloads.concurrency
                preload_counters = self._local_preloads.counters
            metrics.store_concurrency["preload"] = preload_concurrency.report
            metrics.preload_gets = preload_counters.gets

            cluster = self.cluster
            self.status_report = WorkerStatus(
                config,
                metrics,
                self.cache,
                self.fs,
                self.datasets,
                self.prefetcher,
                self.mount,
                started_at=started_at,
                agent=None if cluster is None else cluster.agent,
                preloader=None if cluster is None else cluster.preloader,
                filler=None if cluster is None else cluster.filler,
                tasks=None if cluster is None else cluster.tasks,
            )
            built.pop_all()

    def _cluster_parts(self, routing: PeerRouting, metrics: WorkerMetrics) -> ClusterParts:
        config = self.config
        following, membership, peers = routing.following, routing.membership, routing.peers
        preloader = Preloader(
            self.datasets,
            self.cache,
            membership,
            self.fetchers,
            concurrency=config.preload_concurrency,
            max_concurrency=config.preload_concurrency_max,
        )
        filler = Filler(
            self.datasets,
            self.cache,
            peers,
            membership,
            metrics,
            concurrency=config.fill_concurrency,
        )
        tasks = TaskRunner(self.datasets, self.cache, membership, metrics)
        agent = ClusterAgent(
            self,
            CoordinatorClient(following.coordinator, following.token, timeout=10.0),
            config.node,
            membership,
            preloader,
            filler,
            tasks,
            state_dir=config.state_dir,
            interval_s=config.heartbeat_interval_s,
        )
        peer_server = PeerServer(
            self.fs.serve_peer_block,
            following.token,
            serve_cached_now=self.fs.peer_block_if_cached,
            answer_natively=self.fs.answer_peers_natively,
        )
        return ClusterParts(routing, peer_server, preloader, filler, tasks, agent)

    async def start(self, nursery: trio.Nursery, peer_listener: socket.socket | None) -> None:
        """Start the parts' tasks in ``nursery`` (cancelled at shutdown); in a cluster the peer
        block server serves on ``peer_listener``, handed over."""
        cluster = self.cluster
        if cluster is not None:
            assert peer_listener is not None  # bound with the others before anything was made
            await nursery.start(cluster.routing.peers.run)
            await nursery.start(cluster.peer_server.serve, peer_listener)
        await nursery.start(self.fs.reader.serve_readahead)
        await nursery.start(self.fs.reader.serve_store_gets)
        await nursery.start(self.prefetcher.run)
        if cluster is not None:
            await nursery.start(cluster.preloader.run)
            await nursery.start(cluster.filler.run)
            await nursery.start(cluster.tasks.run)
            await nursery.start(cluster.agent.run)
        if self._local_preloads is not None:
            await nursery.start(self._local_preloads.run)

    def close(self) -> None:
        """Close what was opened (after the mount is gone): fetchers, datasets, the cache
        index (flushed, so the next start is warm), the registry."""
        self.fetchers.close()
        self.datasets.close()
        self.cache.close()
        self.registry.close()

    # --- the control API (WorkerAPI) -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.status_report.document()

    def metrics_text(self) -> bytes:
        return self.status_report.metrics_text()

    def list_datasets(self) -> list[dict[str, Any]]:
        return self.datasets.list_datasets()

    async def add_dataset(self, spec: DatasetSpec, *, allow_empty: bool = False) -> dict[str, Any]:
        return await self.datasets.add_dataset(spec, allow_empty=allow_empty)

    async def remove_dataset(self, name: str, *, keep_cache: bool) -> dict[str, Any]:
        return await self.datasets.remove_dataset(name, keep_cache=keep_cache)

    async def refresh_dataset(self, name: str) -> dict[str, Any]:
        return await self.datasets.refresh_dataset(name)

    def resolve(self, dataset: str, path: str) -> dict[str, Any]:
        return self.short_circuit.resolve(dataset, path)

    async def resolve_many(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        return await self.short_circuit.resolve_many(dataset, paths)

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

    def local_preloads(self) -> LocalPreloads:
        if self._local_preloads is None:
            raise ConfigError(
                f"this worker follows the coordinator at {self.config.coordinator}: preload "
                "there (cachefs --coordinator URL preload …)"
            )
        return self._local_preloads

    def request_shutdown(self) -> None:
        self._request_shutdown()

    # --- the heartbeat agent's calls (ClusterWorker) -----------------------------------------

    def cluster_report(self) -> dict[str, Any]:
        return self.status_report.cluster_report()

    def served_datasets(self) -> dict[str, int]:
        return self.datasets.served_datasets()

    async def add_followed_dataset(self, spec: DatasetSpec, refresh_epoch: int) -> None:
        await self.datasets.add_followed_dataset(spec, refresh_epoch)

    async def remove_followed_dataset(self, name: str) -> None:
        await self.datasets.remove_followed_dataset(name)

    async def refresh_followed_dataset(self, name: str, refresh_epoch: int) -> None:
        await self.datasets.refresh_followed_dataset(name, refresh_epoch)
