"""The coordinator's cluster model, in process: :class:`coordinator.service.Coordinator` (the
model, the Cluster and the CacheManager) over a real LMDB state store in a temporary directory,
driven by a fake clock the tests advance.

Covers datasets (add/remove/refresh), nodes from heartbeats (registration, down after
``down_after_s``, up again), the view handed to workers, locality, durability across a new
``Coordinator`` on the same store, and the preload job lifecycle with shard ownership."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefs.errors import ConfigError, DatasetExists, DatasetNotFound
from cachefs.preload_jobs import Selection
from cachefs.protocol import SHARDS, owner_table
from coordinator.copies import CopyState
from coordinator.errors import NodeNotFound, PreloadNotFound
from coordinator.scheduling.sources import parse_locality_document
from coordinator.service import Coordinator
from coordinator.state import LmdbStateStore
from tests.coordinator_model import (
    DOWN_AFTER_S,
    HEARTBEAT_S,
    SETTINGS,
    T0,
    FakeClock,
    address,
    beat,
    spec,
)


def shard_report(*, complete: bool = True, nbytes: int = 100, failed=None) -> dict:
    failed = failed or {}
    return {
        "objects": 2,
        "bytes": nbytes,
        "done_objects": 2 - len(failed) if complete else 1,
        "done_bytes": nbytes if complete else nbytes // 2,
        "failed": failed,
        "failed_count": len(failed),
        "complete": complete,
    }


def owned(dataset: str, nodes: list[str], node: str) -> list[int]:
    return [shard for shard, owner in enumerate(owner_table(dataset, nodes)) if owner == node]


def report_shards(coordinator: Coordinator, node: str, job_id: str, shards, **kwargs) -> dict:
    reports = {str(shard): shard_report(**kwargs) for shard in shards}
    return beat(coordinator, node, preloads={job_id: reports})


# --- datasets ------------------------------------------------------------------------------------


def test_add_list_get_remove_dataset(coordinator: Coordinator, clock: FakeClock) -> None:
    status = coordinator.add_dataset(spec("imagenet"))
    assert status["name"] == "imagenet"
    assert status["uri"] == "s3://bucket/imagenet/"
    assert status["created_at"] == T0
    assert status["refresh_epoch"] == 0
    assert [(c["id"], c["nodes"], c["fill"]) for c in status["copies"]] == [("A", [], None)]
    assert (status["bytes"], status["cached_bytes"], status["cached_fraction"]) == (0, 0, 0.0)

    coordinator.add_dataset(spec("coco"))
    assert [d["name"] for d in coordinator.list_datasets()] == ["coco", "imagenet"]
    assert coordinator.dataset_status("coco")["uri"] == "s3://bucket/coco/"

    with pytest.raises(DatasetExists):
        coordinator.add_dataset(spec("imagenet", uri="s3://other/"))
    assert coordinator.dataset_status("imagenet")["uri"] == "s3://bucket/imagenet/"

    assert coordinator.remove_dataset("imagenet") == {"name": "imagenet", "removed": True}
    assert [d["name"] for d in coordinator.list_datasets()] == ["coco"]
    with pytest.raises(DatasetNotFound):
        coordinator.dataset_status("imagenet")
    with pytest.raises(DatasetNotFound):
        coordinator.remove_dataset("imagenet")
    # The name is free again.
    clock.advance(5)
    assert coordinator.add_dataset(spec("imagenet"))["created_at"] == T0 + 5


def test_refresh_bumps_the_epoch_in_status_and_view(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    assert coordinator.refresh_dataset("imagenet")["refresh_epoch"] == 1
    assert coordinator.refresh_dataset("imagenet")["refresh_epoch"] == 2
    assert coordinator.dataset_status("imagenet")["refresh_epoch"] == 2
    [entry] = coordinator.view()["datasets"]
    assert entry["refresh_epoch"] == 2
    with pytest.raises(DatasetNotFound):
        coordinator.refresh_dataset("nope")
    with pytest.raises(DatasetNotFound):
        coordinator.cluster.locality("nope")


def test_removing_a_dataset_removes_its_preload_jobs(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    coordinator.add_dataset(spec("coco"))
    doomed = coordinator.cluster.start_preload("imagenet", Selection())
    kept = coordinator.cluster.start_preload("coco", Selection())
    coordinator.remove_dataset("imagenet")
    assert [job["id"] for job in coordinator.cluster.list_preloads()] == [kept["id"]]
    with pytest.raises(PreloadNotFound):
        coordinator.cluster.preload_job(doomed["id"])
    assert [job["id"] for job in coordinator.view()["preloads"]] == [kept["id"]]


# --- nodes ---------------------------------------------------------------------------------------


def test_heartbeat_registers_a_node(coordinator: Coordinator, clock: FakeClock) -> None:
    with pytest.raises(NodeNotFound):
        coordinator.cluster.node_status("n1")
    tiers = [{"name": "ram", "capacity": 1000, "used": 400}]
    view = beat(coordinator, "n1", gpus=8, tiers=tiers)
    assert view["nodes"] == {"n1": {"address": address("n1"), "up": True}}
    clock.advance(1.5)
    status = coordinator.cluster.node_status("n1")
    assert status == {
        "node": "n1",
        "address": address("n1"),
        "state": "up",
        "last_heartbeat_s_ago": 1.5,
        "gpus": 8,
        "tiers": tiers,
        "datasets": [],
        "activity": None,
    }
    # The read counters a worker reports are kept as last reported (`cachefs stats`).
    activity = {"sampled_at": 12.5, "counters": {"files_read": 3}, "fuse_latency": {}}
    beat(coordinator, "n1", activity=activity)
    assert coordinator.cluster.node_status("n1")["activity"] == activity
    beat(coordinator, "n2")
    assert [n["node"] for n in coordinator.cluster.list_nodes()] == ["n1", "n2"]
    # A new address replaces the old one.
    coordinator.heartbeat("n1", {"address": "10.0.0.9:7070"})
    assert coordinator.cluster.node_status("n1")["address"] == "10.0.0.9:7070"
    assert coordinator.view()["nodes"]["n1"]["address"] == "10.0.0.9:7070"


def test_node_goes_down_without_heartbeats_and_up_on_the_next(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    beat(coordinator, "n2")
    clock.advance(DOWN_AFTER_S)  # exactly the limit: still up
    assert coordinator.cluster.check_liveness() == []
    beat(coordinator, "n2")
    clock.advance(0.5)  # n1: 3.5 s without a heartbeat; n2: 0.5 s
    assert coordinator.cluster.check_liveness() == ["n1"]
    assert coordinator.cluster.node_status("n1")["state"] == "down"
    assert coordinator.cluster.node_status("n2")["state"] == "up"
    view = coordinator.view()
    assert view["nodes"]["n1"]["up"] is False
    assert view["nodes"]["n2"]["up"] is True
    assert view["datasets"][0]["copies"] == {"A": ["n2"]}
    assert coordinator.model.live_copy_nodes("imagenet", "A") == ["n2"]
    # Down nodes stay members of the copy.
    assert coordinator.model.copy_nodes("imagenet", "A") == ["n1", "n2"]

    view = beat(coordinator, "n1")
    assert view["nodes"]["n1"]["up"] is True
    assert coordinator.cluster.check_liveness() == []
    assert coordinator.model.live_copy_nodes("imagenet", "A") == ["n1", "n2"]


def test_live_copy_nodes_of_an_explicit_copy(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet"))
    for node in ("n3", "n1", "n2"):
        beat(coordinator, node)
    assert coordinator.model.live_copy_nodes("imagenet", "A") == ["n1", "n2", "n3"]
    # An explicit node list, one member never seen.
    coordinator.model.datasets["imagenet"].copies["B"] = CopyState(nodes=["n3", "n9", "n1"])
    assert coordinator.model.copy_nodes("imagenet", "B") == ["n1", "n3", "n9"]
    assert coordinator.model.live_copy_nodes("imagenet", "B") == ["n1", "n3"]
    clock.advance(DOWN_AFTER_S + 1)
    beat(coordinator, "n3")
    assert coordinator.model.live_copy_nodes("imagenet", "B") == ["n3"]
    assert coordinator.model.live_copy_nodes("imagenet", "A") == ["n3"]
    assert coordinator.view()["datasets"][0]["copies"] == {"A": ["n3"], "B": ["n3"]}


def test_view_contents(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", block_size=1 << 20))
    coordinator.add_dataset(spec("coco"))
    beat(coordinator, "n2")
    view = beat(coordinator, "n1")
    assert view["cluster_id"] == coordinator.cluster_id and len(view["cluster_id"]) == 16
    assert view["heartbeat_interval_s"] == HEARTBEAT_S
    assert list(view["nodes"]) == ["n1", "n2"]
    assert [d["spec"]["name"] for d in view["datasets"]] == ["coco", "imagenet"]
    imagenet = view["datasets"][1]
    assert imagenet["spec"] == coordinator.model.datasets["imagenet"].spec.to_json()
    assert imagenet["spec"]["block_size"] == 1 << 20
    assert imagenet["copies"] == {"A": ["n1", "n2"]}
    assert view["preloads"] == []

    scheduled = coordinator.cluster.start_preload("coco", Selection(at=T0 + 60))
    running = coordinator.cluster.start_preload(
        "imagenet", Selection(paths=("train",), fraction=0.5)
    )
    [assignment] = coordinator.view()["preloads"]
    assert assignment == {
        "id": running["id"],
        "dataset": "imagenet",
        "copy": "A",
        "selection": {"paths": ["train"], "fraction": 0.5, "bytes": None, "at": None},
    }
    assert scheduled["id"] != running["id"]


# --- locality ------------------------------------------------------------------------------------


def dataset_report(cached: int, total: int = 1000, files: int = 10) -> dict:
    return {"bytes": total, "files": files, "cached_bytes": cached, "shards": {"3": cached}}


def test_locality_counts_live_nodes_only(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet"))
    assert coordinator.cluster.locality("imagenet")["fraction"] == 0.0
    beat(coordinator, "n1", datasets={"imagenet": dataset_report(300)})
    beat(coordinator, "n2", datasets={"imagenet": dataset_report(200)})
    beat(coordinator, "n3")  # holds nothing of it
    locality = coordinator.cluster.locality("imagenet")
    assert locality["bytes"] == 1000
    assert locality["files"] == 10
    assert locality["cached_bytes"] == 500
    assert locality["fraction"] == pytest.approx(0.5)
    assert locality["copies"] == [{"id": "A", "nodes": ["n1", "n2", "n3"]}]
    assert locality["nodes"] == [
        {
            "node": "n1",
            "address": address("n1"),
            "state": "up",
            "cached_bytes": 300,
            "fraction": 0.3,
        },
        {
            "node": "n2",
            "address": address("n2"),
            "state": "up",
            "cached_bytes": 200,
            "fraction": 0.2,
        },
    ]
    status = coordinator.dataset_status("imagenet")
    assert (status["bytes"], status["cached_bytes"]) == (1000, 500)
    assert status["cached_fraction"] == pytest.approx(0.5)
    assert coordinator.cluster.node_status("n1")["datasets"] == [
        {"dataset": "imagenet", "cached_bytes": 300, "fraction": 0.3}
    ]

    # n1 goes silent: listed as down, its bytes no longer counted.
    clock.advance(2)
    beat(coordinator, "n2", datasets={"imagenet": dataset_report(200)})
    beat(coordinator, "n3")
    clock.advance(2)
    locality = coordinator.cluster.locality("imagenet")
    assert locality["cached_bytes"] == 200
    assert locality["fraction"] == pytest.approx(0.2)
    assert [(row["node"], row["state"]) for row in locality["nodes"]] == [
        ("n1", "down"),
        ("n2", "up"),
    ]
    assert coordinator.dataset_status("imagenet")["cached_bytes"] == 200


def test_locality_fraction_is_capped_and_unknown_datasets_ignored(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    # Two full replicas (two copies' worth) are still a fraction of 1.
    beat(coordinator, "n1", datasets={"imagenet": dataset_report(1000), "gone": dataset_report(5)})
    beat(coordinator, "n2", datasets={"imagenet": dataset_report(1000)})
    locality = coordinator.cluster.locality("imagenet")
    assert locality["cached_bytes"] == 2000
    assert locality["fraction"] == 1.0
    # A dataset the coordinator does not know is not listed for the node.
    assert [d["dataset"] for d in coordinator.cluster.node_status("n1")["datasets"]] == ["imagenet"]


def test_locality_document_parses(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet"))
    coordinator.add_dataset(spec("coco"))
    tiers = [
        {"name": "ram", "capacity": 100, "used": 30},
        {"name": "ssd", "capacity": 900, "used": 2000},
    ]
    beat(coordinator, "n1", gpus=8, tiers=tiers, datasets={"imagenet": dataset_report(300)})
    beat(coordinator, "n2", gpus=4, datasets={"imagenet": dataset_report(200)})
    clock.advance(2)
    beat(coordinator, "n1", gpus=8, tiers=tiers, datasets={"imagenet": dataset_report(300)})
    clock.advance(2)  # n2 is down now
    document = coordinator.cluster.locality_document()
    datasets, nodes = parse_locality_document(document, "test")
    assert set(datasets) == {"imagenet", "coco"}
    assert datasets["imagenet"].size == 1000
    assert dict(datasets["imagenet"].cached) == {"n1": 300}
    assert datasets["coco"].size == 0 and dict(datasets["coco"].cached) == {}
    assert set(nodes) == {"n1"}
    assert (nodes["n1"].gpus, nodes["n1"].free_gpus) == (8, 8)
    assert document["nodes"]["n1"]["cache_capacity"] == 1000
    assert document["nodes"]["n1"]["cache_used"] == 1000  # capped at the capacity


# --- durability ----------------------------------------------------------------------------------


def test_a_new_cluster_on_the_same_store_sees_everything(state_dir: Path, clock: FakeClock) -> None:
    store = LmdbStateStore(state_dir)
    first = Coordinator(store, SETTINGS, clock=clock)
    first.add_dataset(spec("imagenet"))
    first.add_dataset(spec("coco"))
    first.refresh_dataset("coco")
    beat(first, "n1")
    beat(first, "n2")
    job = first.cluster.start_preload("imagenet", Selection(paths=("train",), fraction=0.25))
    owners = owner_table("imagenet", ["n1", "n2"])
    mine = [shard for shard, owner in enumerate(owners) if owner == "n1"]
    report_shards(first, "n1", job["id"], mine)
    scheduled = first.cluster.start_preload("coco", Selection(bytes=10_000, at=T0 + 3600))
    before = first.cluster.preload_job(job["id"])
    assert before["shards_reported"] == len(mine)
    cluster_id = first.cluster_id
    store.close()

    clock.advance(600)  # long after the last heartbeat
    store = LmdbStateStore(state_dir)
    try:
        second = Coordinator(store, SETTINGS, clock=clock)
        assert second.cluster_id == cluster_id
        assert [d["name"] for d in second.list_datasets()] == ["coco", "imagenet"]
        assert second.dataset_status("coco")["refresh_epoch"] == 1
        assert second.dataset_status("imagenet")["uri"] == "s3://bucket/imagenet/"
        # Known nodes are presumed up for one grace period, so ownership does not move.
        nodes = second.cluster.list_nodes()
        assert [(n["node"], n["state"], n["address"]) for n in nodes] == [
            ("n1", "up", address("n1")),
            ("n2", "up", address("n2")),
        ]
        assert second.model.live_copy_nodes("imagenet", "A") == ["n1", "n2"]
        after = second.cluster.preload_job(job["id"])
        assert after["state"] == "running"
        assert after["selection"] == {
            "paths": ["train"],
            "fraction": 0.25,
            "bytes": None,
            "at": None,
        }
        assert after["shards_reported"] == len(mine)
        assert after["bytes"] == before["bytes"] == 100 * len(mine)
        assert second.cluster.preload_status("coco")["state"] == "scheduled"
        assert second.cluster.preload_status("coco")["id"] == scheduled["id"]
        # Without heartbeats they go down after the grace period.
        clock.advance(DOWN_AFTER_S + 0.1)
        assert sorted(second.cluster.check_liveness()) == ["n1", "n2"]
        # The soft state comes back with the heartbeats.
        beat(second, "n2")
        assert second.model.live_copy_nodes("imagenet", "A") == ["n2"]
    finally:
        store.close()


# --- preload -------------------------------------------------------------------------------------


def test_start_preload_now_or_scheduled(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet"))
    now_job = coordinator.cluster.start_preload("imagenet", Selection(fraction=0.5))
    assert now_job["state"] == "running"
    assert now_job["started_at"] == T0
    assert now_job["dataset"] == "imagenet" and now_job["copy"] == "A"
    assert now_job["shards_total"] == SHARDS
    assert now_job["planned"] is False

    clock.advance(1)
    later = coordinator.cluster.start_preload("imagenet", Selection(at=T0 + 100))
    assert later["state"] == "scheduled" and later["started_at"] is None
    assert coordinator.cluster.preload_status("imagenet")["id"] == later["id"]
    assert [j["id"] for j in coordinator.view()["preloads"]] == [now_job["id"]]
    clock.advance(50)
    coordinator.tick()
    assert coordinator.cluster.preload_job(later["id"])["state"] == "scheduled"
    clock.advance(50)  # exactly at
    coordinator.tick()
    started = coordinator.cluster.preload_job(later["id"])
    assert started["state"] == "running"
    assert started["started_at"] == T0 + 101
    assert {j["id"] for j in coordinator.view()["preloads"]} == {now_job["id"], later["id"]}
    assert [j["id"] for j in coordinator.cluster.list_preloads()] == [now_job["id"], later["id"]]

    # An `at` in the past starts at once.
    past = coordinator.cluster.start_preload("imagenet", Selection(at=T0 - 10))
    assert past["state"] == "running"


def test_start_preload_errors(coordinator: Coordinator) -> None:
    with pytest.raises(DatasetNotFound):
        coordinator.cluster.start_preload("nope", Selection())
    coordinator.add_dataset(spec("imagenet"))
    with pytest.raises(ConfigError):
        coordinator.cluster.start_preload("imagenet", Selection(), copy="Z")
    with pytest.raises(PreloadNotFound):
        coordinator.cluster.preload_status("imagenet")
    with pytest.raises(PreloadNotFound):
        coordinator.cluster.resume_preload("imagenet")
    with pytest.raises(PreloadNotFound):
        coordinator.cluster.cancel_preload("imagenet")
    with pytest.raises(PreloadNotFound):
        coordinator.cluster.preload_job("imagenet-0000000000000-abcd")
    with pytest.raises(DatasetNotFound):
        coordinator.cluster.preload_status("nope")


def test_selection_validation() -> None:
    with pytest.raises(ConfigError):
        Selection(fraction=0.5, bytes=10)
    for fraction in (0.0, -0.1, 1.01, 2.0):
        with pytest.raises(ConfigError):
            Selection(fraction=fraction)
    for nbytes in (0, -5):
        with pytest.raises(ConfigError):
            Selection(bytes=nbytes)
    for path in ("/abs", "a/../b", "..", "x\0y"):
        with pytest.raises(ConfigError):
            Selection(paths=(path,))
    assert Selection(paths=["a/b"], fraction=1.0).paths == ("a/b",)


def test_reports_from_non_owners_are_ignored(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    beat(coordinator, "n2")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    others = owned("imagenet", ["n1", "n2"], "n2")
    assert 0 < len(others) < SHARDS
    # n1 claims every shard: only its own count.
    report_shards(coordinator, "n1", job["id"], range(SHARDS))
    status = coordinator.cluster.preload_job(job["id"])
    mine = owned("imagenet", ["n1", "n2"], "n1")
    assert status["shards_reported"] == len(mine)
    assert status["bytes"] == 100 * len(mine)
    assert status["state"] == "running"
    # A new node registers with this very heartbeat: it joins the copy (every registered
    # node) and its reports count for the shards it now owns, and only those.
    report_shards(coordinator, "n7", job["id"], others)
    three = ["n1", "n2", "n7"]
    counted = len(owned("imagenet", three, "n1")) + len(
        set(owned("imagenet", three, "n7")) & set(others)
    )
    assert counted < len(mine) + len(others)
    assert coordinator.cluster.preload_job(job["id"])["shards_reported"] == counted
    # Reports for unknown jobs and out-of-range shards are ignored without error.
    beat(coordinator, "n2", preloads={"no-such-job": {"0": shard_report()}})
    beat(coordinator, "n2", preloads={job["id"]: {"1024": shard_report(), "-1": shard_report()}})
    assert coordinator.cluster.preload_job(job["id"])["shards_reported"] == counted


def test_reports_from_nodes_outside_the_jobs_copy_are_ignored(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    for node in ("n1", "n2", "n3"):
        beat(coordinator, node)
    # Copy B holds n1 and n2 only.
    coordinator.model.datasets["imagenet"].copies["B"] = CopyState(nodes=["n1", "n2"])
    job = coordinator.cluster.start_preload("imagenet", Selection(), copy="B")
    assert job["copy"] == "B"
    report_shards(coordinator, "n3", job["id"], range(SHARDS))
    assert coordinator.cluster.preload_job(job["id"])["shards_reported"] == 0
    report_shards(coordinator, "n1", job["id"], range(SHARDS))
    report_shards(coordinator, "n2", job["id"], range(SHARDS))
    assert coordinator.cluster.preload_job(job["id"])["state"] == "completed"


def test_job_completes_only_when_every_shard_is_reported_complete(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    nodes = ["n1", "n2", "n3"]
    for node in nodes:
        beat(coordinator, node)
    job = coordinator.cluster.start_preload("imagenet", Selection(fraction=0.5))
    shares = {node: owned("imagenet", nodes, node) for node in nodes}
    assert sum(len(s) for s in shares.values()) == SHARDS

    report_shards(coordinator, "n1", job["id"], shares["n1"])
    report_shards(coordinator, "n2", job["id"], shares["n2"])
    # n3: all but one shard complete, that one in progress.
    *done, last = shares["n3"]
    clock.advance(1)
    reports = {str(s): shard_report() for s in done}
    reports[str(last)] = shard_report(complete=False)
    beat(coordinator, "n3", preloads={job["id"]: reports})
    coordinator.tick()
    status = coordinator.cluster.preload_job(job["id"])
    assert status["state"] == "running"
    assert status["planned"] is True
    assert status["shards_reported"] == SHARDS
    assert status["shards_done"] == SHARDS - 1
    assert status["bytes"] == 100 * SHARDS
    assert status["bytes_done"] == 100 * SHARDS - 50
    assert status["objects"] == 2 * SHARDS and status["objects_done"] == 2 * SHARDS - 1
    assert status["elapsed_s"] == 1.0
    assert status["rate_bytes_per_s"] == pytest.approx(100 * SHARDS - 50)
    assert status["eta_s"] == pytest.approx(50 / (100 * SHARDS - 50))
    assert [j["id"] for j in coordinator.view()["preloads"]] == [job["id"]]

    clock.advance(1)
    report_shards(coordinator, "n3", job["id"], [last])
    status = coordinator.cluster.preload_status("imagenet")
    assert status["state"] == "completed"
    assert status["finished_at"] == T0 + 2
    assert status["shards_done"] == SHARDS
    assert status["bytes_done"] == 100 * SHARDS
    assert status["failed_count"] == 0 and status["failed"] == []
    assert status["eta_s"] is None
    assert coordinator.view()["preloads"] == []
    # Later reports change nothing.
    report_shards(coordinator, "n3", job["id"], [last], complete=False)
    assert coordinator.cluster.preload_status("imagenet")["state"] == "completed"


def test_failures_make_the_job_failed_with_the_objects_listed(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    failed = {"train/a.jpg": "503 SlowDown", "train/b.jpg": "not admitted: the cache is full"}
    reports = {str(s): shard_report() for s in range(SHARDS)}
    reports["17"] = shard_report(failed=failed)
    beat(coordinator, "n1", preloads={job["id"]: reports})
    status = coordinator.cluster.preload_status("imagenet")
    assert status["state"] == "failed"
    assert status["failed_count"] == 2
    assert sorted(status["failed"], key=lambda f: f["key"]) == [
        {"key": "train/a.jpg", "reason": "503 SlowDown", "node": "n1"},
        {"key": "train/b.jpg", "reason": "not admitted: the cache is full", "node": "n1"},
    ]
    assert status["objects_done"] == 2 * SHARDS - 2


def test_failure_list_is_bounded_but_the_count_exact(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    failed = {f"k{i}": "boom" for i in range(50)}
    reports = {str(s): shard_report() for s in range(SHARDS)}
    reports["0"] = {**shard_report(failed=failed), "failed_count": 50}
    beat(coordinator, "n1", preloads={job["id"]: reports})
    status = coordinator.cluster.preload_status("imagenet")
    assert status["state"] == "failed"
    assert status["failed_count"] == 50
    assert len(status["failed"]) == 20


def test_owner_change_discounts_the_old_owners_reports(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    beat(coordinator, "n2")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    two = ["n1", "n2"]
    report_shards(coordinator, "n2", job["id"], owned("imagenet", two, "n2"))
    assert coordinator.cluster.preload_job(job["id"])["shards_reported"] == len(
        owned("imagenet", two, "n2")
    )

    # n2 goes silent; n1 keeps beating.
    for _ in range(4):
        clock.advance(1)
        beat(coordinator, "n1")
    assert coordinator.cluster.check_liveness() == ["n2"]
    status = coordinator.cluster.preload_job(job["id"])
    assert status["shards_reported"] == 0  # n2's reports no longer count
    assert status["bytes"] == 0

    # n1 reports the shards it owned all along: not complete, n2's former shards are missing.
    report_shards(coordinator, "n1", job["id"], owned("imagenet", two, "n1"))
    coordinator.tick()
    status = coordinator.cluster.preload_job(job["id"])
    assert status["state"] == "running"
    assert status["shards_reported"] == len(owned("imagenet", two, "n1"))
    # n1, the new owner of n2's shards, reports them: complete.
    report_shards(coordinator, "n1", job["id"], owned("imagenet", two, "n2"))
    status = coordinator.cluster.preload_job(job["id"])
    assert status["state"] == "completed"
    assert status["shards_reported"] == SHARDS


def test_tick_completes_a_job_once_ownership_returns_to_the_reporters(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    two, three = ["n1", "n2"], ["n1", "n2", "n3"]
    beat(coordinator, "n1")
    beat(coordinator, "n2")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    # One shard n2 owns with or without n3; it reports that one as in progress at first.
    kept = sorted(set(owned("imagenet", two, "n2")) & set(owned("imagenet", three, "n2")))[0]
    report_shards(coordinator, "n1", job["id"], owned("imagenet", two, "n1"))
    reports = {str(s): shard_report() for s in owned("imagenet", two, "n2")}
    reports[str(kept)] = shard_report(complete=False)
    beat(coordinator, "n2", preloads={job["id"]: reports})

    beat(coordinator, "n3")  # joins, takes shards, reports nothing
    report_shards(coordinator, "n2", job["id"], [kept])
    coordinator.tick()
    status = coordinator.cluster.preload_job(job["id"])
    assert status["state"] == "running"
    assert status["shards_reported"] == SHARDS - len(owned("imagenet", three, "n3"))

    for _ in range(4):  # n3 goes silent
        clock.advance(1)
        beat(coordinator, "n1")
        beat(coordinator, "n2")
    assert coordinator.cluster.preload_job(job["id"])["state"] == "running"
    coordinator.tick()
    status = coordinator.cluster.preload_job(job["id"])
    assert status["state"] == "completed"
    assert status["finished_at"] == clock.now


def test_a_job_with_no_live_node_does_not_complete(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    job = coordinator.cluster.start_preload("imagenet", Selection())
    coordinator.tick()
    status = coordinator.cluster.preload_job(job["id"])
    assert (status["state"], status["shards_reported"]) == ("running", 0)


def test_resume_creates_a_new_job_with_the_same_selection(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    selection = Selection(paths=("train", "val/x"), bytes=123_456, at=T0 + 5)
    job = coordinator.cluster.start_preload("imagenet", selection)
    # Resuming a job that has not ended returns that job.
    assert coordinator.cluster.resume_preload("imagenet")["id"] == job["id"]
    clock.advance(10)
    coordinator.tick()
    reports = {str(s): shard_report() for s in range(SHARDS)}
    reports["5"] = shard_report(failed={"train/x": "boom"})
    beat(coordinator, "n1", preloads={job["id"]: reports})
    assert coordinator.cluster.preload_status("imagenet")["state"] == "failed"

    clock.advance(1)
    resumed = coordinator.cluster.resume_preload("imagenet")
    assert resumed["id"] != job["id"]
    assert resumed["state"] == "running"
    assert resumed["selection"] == {
        "paths": ["train", "val/x"],
        "bytes": 123_456,
        "fraction": None,
        "at": None,
    }
    assert resumed["copy"] == "A"
    assert resumed["shards_reported"] == 0
    assert coordinator.cluster.preload_status("imagenet")["id"] == resumed["id"]
    assert coordinator.cluster.preload_job(job["id"])["state"] == "failed"  # the old record stays
    assert coordinator.cluster.preload_job(job["id"])["failed_count"] == 1


def test_cancel_preload(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet"))
    beat(coordinator, "n1")
    job = coordinator.cluster.start_preload("imagenet", Selection())
    clock.advance(2)
    cancelled = coordinator.cluster.cancel_preload("imagenet")
    assert cancelled["id"] == job["id"]
    assert cancelled["state"] == "cancelled"
    assert cancelled["finished_at"] == T0 + 2
    assert coordinator.view()["preloads"] == []
    # Reports for a cancelled job are ignored; cancelling again changes nothing.
    report_shards(coordinator, "n1", job["id"], range(SHARDS))
    assert coordinator.cluster.preload_job(job["id"])["state"] == "cancelled"
    assert coordinator.cluster.preload_job(job["id"])["shards_reported"] == 0
    clock.advance(2)
    assert coordinator.cluster.cancel_preload("imagenet")["finished_at"] == T0 + 2
    # A cancelled scheduled job never starts.
    clock.advance(1)
    later = coordinator.cluster.start_preload("imagenet", Selection(at=T0 + 100))
    coordinator.cluster.cancel_preload("imagenet")
    clock.advance(200)
    coordinator.tick()
    assert coordinator.cluster.preload_job(later["id"])["state"] == "cancelled"
    # Resume after a cancel starts the same selection again, now.
    resumed = coordinator.cluster.resume_preload("imagenet")
    assert resumed["state"] == "running" and resumed["id"] not in (job["id"], later["id"])
