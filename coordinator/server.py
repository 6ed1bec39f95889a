"""Running the coordinator: `cachefs coordinator --listen HOST:PORT --state DIR`.

One trio nursery: the HTTP API (hypercorn) and a ticker that starts scheduled preloads,
finishes jobs and logs nodes going down. State is in ``<state>/coordinator`` (LMDB) unless
``--store etcd://…`` names an etcd cluster. The bearer token comes from ``--token-file``, else
``$CACHEFS_TOKEN``, else ``<state>/token``, generated (mode 0600) on first start; the CLI on
the same machine finds it there.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator

import trio
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from cachefs.errors import ConfigError
from cachefs.pidlock import LockHeld, take_pid_lock
from cachefs.preload_jobs import STATES as PRELOAD_STATES

from .api import create_app
from .json_types import JsonDoc
from .service import Coordinator
from .settings import CoordinatorSettings
from .state import open_state_store

log = logging.getLogger("coordinator")

TOKEN_FILE = "token"
# How long the per-job preload series of a finished (completed, failed, cancelled) job stay on
# /metrics: long enough for scrapes to see its last numbers, short enough that the series of
# old jobs do not pile up (cachefs_preload_jobs counts every job by state, without end).
PRELOAD_SERIES_RETENTION_S = 3600.0


def load_or_create_token(state_dir: str, token_file: str | None) -> str:
    if token_file:
        token = _read_token(token_file)
    elif os.environ.get("CACHEFS_TOKEN"):
        token = os.environ["CACHEFS_TOKEN"].strip()
    else:
        path = os.path.join(state_dir, TOKEN_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return _read_token(path)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("generated an API token in %s", path)
        return _read_token(path)
    if not token:
        raise ConfigError("the API token is empty")
    return token


def _read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"the token file {path} is empty")
    return token


class _ClusterCollector(Collector):
    """Coordinator metrics, computed at scrape time from the coordinator's state.

    Labels never use ``job`` or ``instance``: Prometheus sets those itself and would rename
    ours ``exported_job``. A preload job is labelled ``preload``."""

    def __init__(self, coordinator: Coordinator, clock: Callable[[], float] = time.time):
        self._coordinator = coordinator
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        coordinator = self._coordinator
        up = GaugeMetricFamily("cachefs_node_up", "1 if the node is up", labels=["node"])
        for node in coordinator.cluster.list_nodes():
            up.add_metric([node["node"]], 1.0 if node["state"] == "up" else 0.0)
        yield up
        cached = GaugeMetricFamily(
            "cachefs_dataset_cluster_cached_bytes", "Cached bytes on live nodes", labels=["dataset"]
        )
        fraction = GaugeMetricFamily(
            "cachefs_dataset_cluster_cached_fraction", "Cached fraction", labels=["dataset"]
        )
        datasets = coordinator.list_datasets()
        for dataset in datasets:
            cached.add_metric([dataset["name"]], dataset["cached_bytes"])
            fraction.add_metric([dataset["name"]], dataset["cached_fraction"])
        yield cached
        yield fraction
        yield from self._preload_metrics(coordinator.cluster.list_preloads(), self._clock())
        yield from self._cache_manager_metrics(datasets, coordinator.manager.freed_bytes)

    @staticmethod
    def _preload_metrics(jobs: list[JsonDoc], now: float) -> Iterator[Metric]:
        """Jobs by state per dataset (bounded: datasets x states), and the progress of each
        job that runs, waits or ended less than PRELOAD_SERIES_RETENTION_S ago."""
        by_state = GaugeMetricFamily(
            "cachefs_preload_jobs", "Preload jobs by state", labels=["dataset", "state"]
        )
        counts: dict[str, dict[str, int]] = {}
        for job in jobs:
            per_state = counts.setdefault(job["dataset"], dict.fromkeys(PRELOAD_STATES, 0))
            per_state[job["state"]] += 1
        for dataset, per_state in sorted(counts.items()):
            for state, count in per_state.items():
                by_state.add_metric([dataset, state], count)
        yield by_state
        progress = {
            "bytes": "Bytes the preload job selected (final once every shard is planned)",
            "bytes_done": "Bytes of the preload job cached and verified",
            "objects": "Objects the preload job selected",
            "objects_done": "Objects of the preload job cached and verified",
            "failed_objects": "Objects the preload job could not load",
        }
        families = {
            name: GaugeMetricFamily(f"cachefs_preload_{name}", doc, labels=["dataset", "preload"])
            for name, doc in progress.items()
        }
        for job in jobs:
            ended = job["finished_at"]
            if ended is not None and now - ended > PRELOAD_SERIES_RETENTION_S:
                continue
            labels = [job["dataset"], job["id"]]
            for name in ("bytes", "bytes_done", "objects", "objects_done"):
                families[name].add_metric(labels, job[name])
            families["failed_objects"].add_metric(labels, job["failed_count"])
        yield from families.values()

    @staticmethod
    def _cache_manager_metrics(
        datasets: list[JsonDoc], freed_bytes: dict[tuple[str, str], int]
    ) -> Iterator[Metric]:
        used_ratio = GaugeMetricFamily(
            "cachefs_cache_used_ratio",
            "Cache used / capacity over a copy's live nodes (for an autoscaler)",
            labels=["dataset", "copy"],
        )
        jobs = GaugeMetricFamily(
            "cachefs_jobs", "Registered jobs by state", labels=["dataset", "state"]
        )
        freed = CounterMetricFamily(
            "cachefs_cleanup_freed_bytes",
            "Bytes workers freed on the coordinator's request since it started",
            labels=["dataset", "kind"],
        )
        filling = GaugeMetricFamily(
            "cachefs_copy_filling", "1 while a copy fills from peers", labels=["dataset", "copy"]
        )
        for dataset in datasets:
            name = dataset["name"]
            for copy in dataset["copies"]:
                used_ratio.add_metric([name, copy["id"]], copy["used_ratio"])
                filling.add_metric([name, copy["id"]], 1.0 if copy["fill"] else 0.0)
            for state, count in dataset["jobs"].items():
                jobs.add_metric([name, state], count)
        for (name, kind), nbytes in sorted(freed_bytes.items()):
            freed.add_metric([name, kind], nbytes)
        yield from (used_ratio, jobs, freed, filling)


async def serve(
    settings: CoordinatorSettings,
    *,
    state_dir: str,
    token_file: str | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the coordinator until SIGINT or SIGTERM: its state in ``state_dir`` (LMDB, unless
    ``settings.store`` names etcd), its token from ``token_file`` (see the module's
    docstring)."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    try:
        lock = take_pid_lock(os.path.join(state_dir, "coordinator.lock"))
    except LockHeld as held:
        raise ConfigError(
            f"another coordinator (pid {held.holder}) uses state directory {state_dir}"
        ) from None
    token = load_or_create_token(state_dir, token_file)
    store = await trio.to_thread.run_sync(
        open_state_store, settings.store or os.path.join(state_dir, "coordinator")
    )
    try:
        coordinator = await trio.to_thread.run_sync(lambda: Coordinator(store, settings))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ClusterCollector(coordinator))
        app = create_app(coordinator, token, metrics_text=lambda: generate_latest(registry))
        hyper = HypercornConfig()
        hyper.bind = [settings.listen]
        hyper.accesslog = None
        hyper.errorlog = logging.getLogger("coordinator.http")
        hyper.graceful_timeout = 1.0
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            # hypercorn types its app as its own ASGI callable, narrower than Starlette's.
            await nursery.start(
                lambda task_status: hypercorn_serve(
                    app,  # type: ignore[arg-type]
                    hyper,
                    shutdown_trigger=shutdown.wait,
                    task_status=task_status,
                )
            )
            log.info("coordinator on http://%s (state %s, store %s)", settings.listen,
                     state_dir, store.where)  # fmt: skip
            task_status.started()
            async with trio.open_nursery() as background:
                background.start_soon(_tick, coordinator, settings.heartbeat_interval_s / 2)
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("received %s, shutting down", signal.Signals(signum).name)
                        break
                background.cancel_scope.cancel()
            shutdown.set()
    finally:
        store.close()
        lock.close()


async def _tick(coordinator: Coordinator, period_s: float) -> None:
    down: set[str] = set()
    while True:
        await trio.sleep(period_s)
        await trio.to_thread.run_sync(coordinator.tick)
        now_down = set(await trio.to_thread.run_sync(coordinator.cluster.check_liveness))
        for node in sorted(now_down - down):
            log.warning("node %r missed its heartbeats: marked down, its shards re-owned", node)
        down = now_down
