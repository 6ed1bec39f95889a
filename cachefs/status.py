"""What a worker says about itself: the status document (``GET /v1/status``, `cachefs status`),
the Prometheus families computed at each scrape (tiers, prefetch hints, datasets; the counters
the read path keeps are cachefs/metrics.py's), and the heartbeat report a worker that follows a
coordinator sends it. (`cachefs stats`, the live view of these, is cachefs/stats.py.)
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from dataclasses import fields
from typing import Any, Protocol

from prometheus_client import generate_latest
from prometheus_client.core import Metric

from cachefs import __version__
from cachefs.cache.base import BlockCache
from cachefs.cluster.agent import ClusterAgent
from cachefs.cluster.fill import Filler
from cachefs.cluster.preload import Preloader
from cachefs.cluster.tasks import TaskRunner
from cachefs.datasets import DatasetManager
from cachefs.fs.core import FileSystem
from cachefs.fs.prefetch import Prefetcher
from cachefs.metrics import WorkerMetrics, counter, gauge, labelled_counter, make_registry
from cachefs.settings import WorkerConfig

#: How many objects the worker froze out of the garbage collector, counted once when it froze
#: them (:func:`note_frozen`): ``gc.get_freeze_count()`` walks every frozen object, on the
#: FUSE loop (~91,000 in a worker with no dataset: ~12 ms per status request,
#: bench/results/status/2026-12-03.md), and `cachefs stats` asks every second.
_frozen_objects = 0


def note_frozen() -> None:
    """Count the frozen objects now (cachefs/worker.py tune_gc calls this after gc.freeze)."""
    global _frozen_objects
    _frozen_objects = gc.get_freeze_count()


def frozen_objects() -> int:
    """The objects frozen at the last :func:`note_frozen` (0 before the worker serves)."""
    return _frozen_objects


class MountState(Protocol):
    """The FUSE mount (cachefs/fs/mount.py) as the status shows it."""

    mounted: bool
    no_open: bool

    def serving_stats(self) -> dict[str, Any] | None: ...


class WorkerStatus:
    def __init__(
        self,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        cache: BlockCache,
        fs: FileSystem,
        datasets: DatasetManager,
        prefetcher: Prefetcher,
        mount: MountState,
        *,
        started_at: float,
        agent: ClusterAgent | None = None,
        preloader: Preloader | None = None,
        filler: Filler | None = None,
        tasks: TaskRunner | None = None,
    ) -> None:
        """``agent``, ``preloader``, ``filler``, ``tasks``: a cluster worker's parts (None on a
        single node)."""
        self._config = config
        self._metrics = metrics
        self._cache = cache
        self._fs = fs
        self._datasets = datasets
        self._prefetcher = prefetcher
        self._mount = mount
        self._started_at = started_at
        self._agent = agent
        self._preloader = preloader
        self._filler = filler
        self._tasks = tasks
        self._registry = make_registry(metrics, self.gauges)

    def document(self) -> dict[str, Any]:
        """The status document: ``GET /v1/status``, what `cachefs status` prints."""
        m = self._metrics
        counters = self._cache.counters()
        return {
            "version": __version__,
            "node": self._config.node,
            "pid": os.getpid(),
            "mount": self._config.mountpoint,
            "mounted": self._mount.mounted,
            "state_dir": self._config.state_dir,
            "uptime_s": time.time() - self._started_at,
            "admission": self._config.admission,
            "promote": self._config.promote,
            "fuse_no_open": self._mount.no_open,
            # The garbage collector as cachefs/worker.py tune_gc leaves it once serving.
            "gc": {
                "frozen_objects": frozen_objects(),
                "thresholds": list(gc.get_threshold()),
                "collections": [g["collections"] for g in gc.get_stats()],
            },
            # The native READ path's counters; None when every READ is served in Python.
            "fuse_fast_read": None if self._fs.native is None else self._fs.native.stats(),
            # The serving processes of --fuse-processes (cachefs/fs/serving.py); None with one.
            "fuse_processes": self._mount.serving_stats(),
            "tiers": [fields_of(usage) for usage in self._cache.usage()],
            "reads": {
                "hits": m.served_hits(),
                "misses": m.misses,
                "hit_ratio": m.hit_ratio(),
                "bytes_served": m.served_bytes(),
                "coalesced": m.fetch_coalesced,
                "readahead_blocks": m.readahead_blocks,
            },
            "prefetch": self._prefetcher.status(),
            "cache": fields_of(counters),
            "store": {
                "requests": {
                    f"{op}:{outcome}": n for (op, outcome), n in m.store_request_counts().items()
                },
                "bytes": m.store_bytes,
                "gets_in_loop": m.store_gets_in_loop,
                # The adaptive limits on GETs in flight, per purpose ("read", "preload").
                "concurrency": {
                    purpose: report() for purpose, report in m.store_concurrency.items()
                },
            },
            "peers": {
                "requests": m.peer_request_counts(),
                "blocks_served": m.peer_served,
                # Connections the native path sends READs on (cachefs/fs/native_peer_reads.py).
                "native_connections": (
                    0 if self._fs.native_peers is None else self._fs.native_peers.connections
                ),
            },
            "fill": {"blocks": dict(m.fill_blocks), "bytes": m.fill_bytes},
            "activity": m.activity(),  # what `cachefs stats` shows
            "cluster": self._cluster_status(),
            "cleanup": self._cleanup_status(),
            "open_files": self._fs.open_handles(),
            "datasets": self._datasets.list_datasets(),
            "rss_bytes": rss_bytes(),
        }

    def _cluster_status(self) -> dict[str, Any] | None:
        agent, preloader, filler = self._agent, self._preloader, self._filler
        if agent is None or preloader is None or filler is None:  # a single node
            return None
        return {
            "coordinator": self._config.coordinator,
            "listen": self._config.listen,
            "connected": agent.connected,
            "error": agent.last_error,
            "preload": {
                "jobs": sorted(preloader.reports()),
                "fetched_blocks": preloader.fetched_blocks,
                "fetched_bytes": preloader.fetched_bytes,
                "failures": preloader.fetch_failures,
            },
            "fills": filler.reports(),
        }

    def _cleanup_status(self) -> dict[str, Any]:
        """Bytes freed by cleanup tasks per dataset and kind, and the last tasks run."""
        freed: dict[str, dict[str, int]] = {}
        for (dataset, kind), nbytes in sorted(self._metrics.freed_bytes.items()):
            freed.setdefault(dataset, {})[kind] = nbytes
        return {
            "freed_bytes": freed,
            "tasks": [] if self._tasks is None else list(self._tasks.history),
        }

    def cluster_report(self) -> dict[str, Any]:
        """This node's heartbeat: peer address, tiers, and per dataset its size, the bytes
        cached here, in total and per shard (the coordinator's locality data), and when it was
        last read here (idle-copy cleanup). The agent adds preload, fill and task results."""
        last_read_at = self._fs.reader.last_read_at
        datasets = {}
        for dataset in self._fs.datasets():
            stats = dataset.snapshot.stats
            source_id = dataset.source.source_id
            datasets[dataset.name] = {
                "bytes": stats.bytes,
                "files": stats.files,
                "cached_bytes": self._cache.cached_bytes(source_id),
                "shards": {
                    str(shard): nbytes
                    for shard, nbytes in self._cache.cached_bytes_by_shard(source_id).items()
                },
                "last_read_at": last_read_at.get(dataset.name, 0.0),
            }
        return {
            "address": self._config.listen,
            "gpus": self._config.gpus,
            "tiers": [
                {"name": u.name, "capacity": u.capacity, "used": u.used}
                for u in self._cache.usage()
            ],
            "datasets": datasets,
            "activity": self._metrics.activity(),  # `cachefs stats --coordinator` shows it
        }

    def metrics_text(self) -> bytes:
        """The Prometheus text of ``GET /metrics``."""
        return generate_latest(self._registry)

    def gauges(self) -> Iterator[Metric]:
        """The families computed at each scrape, beside WorkerMetrics' own counters."""
        usage = self._cache.usage()
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
        counters = self._cache.counters()
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
        hints = self._prefetcher.counters
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
            [([], len(self._prefetcher))],
        )
        rows_cached, rows_fraction = [], []
        for dataset in self._fs.datasets():
            cached = self._cache.cached_bytes(dataset.source.source_id)
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


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass instance's fields by name (not deep-copied, as ``asdict`` would)."""
    return {item.name: getattr(obj, item.name) for item in fields(obj)}


def rss_bytes() -> int:
    return _statm_bytes(1)


def mapped_file_bytes() -> int:
    """The part of :func:`rss_bytes` that is mapped files (and shared memory): the loaded
    libraries, and the snapshot pages LMDB's reads have mapped."""
    return _statm_bytes(2)


def _statm_bytes(field: int) -> int:
    """Field ``field`` of /proc/self/statm (counted in pages), in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
