"""The coordinator's preload metrics stay bounded: a job's progress series live while it runs
or waits and for PRELOAD_SERIES_RETENTION_S after it ends; cachefs_preload_jobs counts every
job by state. A real Cluster on a real LMDB store, read through the collector /metrics uses,
with a hand-moved clock (no sleeping)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from cachefs.preload_jobs import Selection
from cachefs.protocol import DatasetSpec
from coordinator.server import PRELOAD_SERIES_RETENTION_S, _ClusterCollector
from coordinator.service import Coordinator
from coordinator.state import LmdbStateStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def scrape(coordinator: Coordinator, clock: Clock) -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ClusterCollector(coordinator, clock))
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_finished_preloads_leave_metrics_after_the_retention(tmp_path) -> None:
    clock = Clock()
    store = LmdbStateStore(tmp_path / "state")
    try:
        coordinator = Coordinator(store, clock=clock)
        coordinator.add_dataset(DatasetSpec.from_json({"name": "imagenet", "uri": "s3://b/i/"}))
        ended = []
        for _ in range(50):  # a preload started and cancelled over and over
            ended.append(coordinator.cluster.start_preload("imagenet", Selection())["id"])
            coordinator.cluster.cancel_preload("imagenet")
            clock.now += 1
        running = coordinator.cluster.start_preload("imagenet", Selection())["id"]

        samples = scrape(coordinator, clock)
        shown = {s.labels["preload"] for s in samples["cachefs_preload_bytes_done"]}
        assert shown == {*ended, running}
        labels = {tuple(sorted(s.labels)) for s in samples["cachefs_preload_bytes"]}
        assert labels == {("dataset", "preload")}  # no "job": Prometheus's own label

        clock.now += PRELOAD_SERIES_RETENTION_S + 1
        samples = scrape(coordinator, clock)
        for name in ("bytes", "bytes_done", "objects", "objects_done", "failed_objects"):
            shown = [s.labels["preload"] for s in samples[f"cachefs_preload_{name}"]]
            assert shown == [running], (name, shown)
        by_state = {s.labels["state"]: s.value for s in samples["cachefs_preload_jobs"]}
        assert by_state == {
            "scheduled": 0,
            "running": 1,
            "completed": 0,
            "failed": 0,
            "cancelled": 50,
        }
    finally:
        store.close()
