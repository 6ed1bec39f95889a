"""The CacheManager end to end: a real coordinator and real workers (own FUSE mount, state and
RAM tier each, on 127.0.0.2…), a real S3 endpoint (moto) behind the fault proxy that counts every
GET the workers send to the store. Every read is compared byte for byte with what was uploaded.

- Suspend: the third job over a limit of 2 waits, is promoted at the first release, and the
  queue keeps its order across a coordinator kill -9;
- Clone: the third job gets a new copy on other nodes, filled from the first copy's peers with
  no store GET, while it already reads the right bytes;
- TDCS placement of a job over candidate nodes;
- cleanup: ttl frees an idle copy, lock never does, lru frees the older dataset first; the
  reserve survives all three;
- scaling out then in hands shards off: no wrong byte, no block fetched twice from the store.
"""

from __future__ import annotations

import random
import re
import threading

import httpx
import pytest

from cachefs.client import CoordinatorClient
from tests.cluster_process import TOKEN, Cluster, read_all, total_bytes, wait_for
from tests.worker_process import drop_page_cache

BLOCK = 256 << 10


def make_files(seed: int, count: int = 24, largest: int = 150_000) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 3}/f{i}.bin": rng.randbytes(rng.randint(1, largest)) for i in range(count)}
    files["big/blob"] = rng.randbytes(2 * BLOCK + 999)  # three blocks
    return files


def blocks_of(files: dict[str, bytes]) -> int:
    return sum(-(-len(data) // BLOCK) for data in files.values())


@pytest.fixture(scope="module")
def bucket(moto_s3):
    """Three datasets under three prefixes of one bucket (different URIs: separate caches)."""
    name = moto_s3.make_bucket()
    datasets = {prefix: make_files(seed) for seed, prefix in enumerate(["ds", "old", "new"])}
    for prefix, files in datasets.items():
        for key, data in files.items():
            moto_s3.put(name, f"{prefix}/{key}", data)
    return name, datasets


def start_cluster(tmp_path, nodes: int, **options) -> Cluster:
    return Cluster(str(tmp_path / "cluster"), nodes, **options).start()


def add(cluster: Cluster, bucket, fault_proxy, prefix: str = "ds", **policy) -> dict[str, bytes]:
    bucket_name, datasets = bucket
    cluster.add_dataset(
        prefix,
        f"s3://{bucket_name}/{prefix}",
        endpoint=fault_proxy.url,
        block_size=BLOCK,
        **policy,
    )
    return datasets[prefix]


def copy_of(cluster: Cluster, dataset: str, copy_id: str) -> dict:
    return next(c for c in cluster.client.dataset(dataset)["copies"] if c["id"] == copy_id)


def fill_done(cluster: Cluster, dataset: str, copy_id: str, timeout: float | None = None) -> None:
    wait_for(
        lambda: copy_of(cluster, dataset, copy_id)["fill"] is None,
        f"fill of copy {copy_id} of {dataset}",
        timeout,
    )


def cached_on(cluster: Cluster, node: str, dataset: str) -> int:
    return cluster.worker(node).dataset_status(dataset)["cached_bytes"]


def reserved_on(cluster: Cluster, node: str) -> int:
    return sum(tier["reserved_used"] for tier in cluster.worker(node).status()["tiers"])


# --- Suspend -------------------------------------------------------------------------------------


def test_suspend_promotes_at_release_in_fifo_order_across_a_restart(tmp_path, bucket, fault_proxy):
    cluster = start_cluster(tmp_path, 2)
    try:
        add(cluster, bucket, fault_proxy, max_jobs_per_copy=2, overflow="suspend")
        client = cluster.client
        assert client.submit_job("j1", "ds", 2)["state"] == "running"
        assert client.submit_job("j2", "ds", 1)["state"] == "running"
        j3 = client.submit_job("j3", "ds", 1)
        j4 = client.submit_job("j4", "ds", 1)
        assert (j3["state"], j3["position"]) == ("suspended", 1)
        assert (j4["state"], j4["position"]) == ("suspended", 2)

        cluster.coordinator.kill9()
        cluster.coordinator.start()
        wait_for(lambda: all(n["state"] == "up" for n in client.nodes()), "nodes back")
        assert [(j["id"], j["position"]) for j in client.jobs()] == [
            ("j1", None), ("j2", None), ("j3", 1), ("j4", 2)
        ]  # fmt: skip

        # j3's owner long-polls; the release promotes j3 (not j4) at once.
        answer = {}
        owner = CoordinatorClient(cluster.coordinator.url, TOKEN)
        poll = threading.Thread(target=lambda: answer.update(owner.job("j3", wait_s=20)))
        poll.start()
        released = client.release_job("j1")
        poll.join(timeout=30)
        owner.close()
        assert released["promoted"] == ["j3"]
        assert answer["state"] == "running" and answer["copy"] == "A"
        assert client.job("j4")["position"] == 1
        assert client.release_job("j2")["promoted"] == ["j4"]
    finally:
        cluster.cleanup()


# --- Clone and placement -------------------------------------------------------------------------


def test_clone_fills_from_peers_while_its_job_reads(tmp_path, bucket, fault_proxy):
    cluster = start_cluster(tmp_path, 4)
    try:
        files = add(
            cluster, bucket, fault_proxy, max_jobs_per_copy=2, overflow="clone", nodes=["n1", "n2"]
        )
        assert cluster.preload("ds")["state"] == "completed"
        client = cluster.client
        client.submit_job("j1", "ds", 2)
        client.submit_job("j2", "ds", 2)
        fault_proxy.reset_counts()
        j3 = client.submit_job("j3", "ds", 2)
        assert (j3["state"], j3["cloned"], j3["copy"]) == ("running", True, "B")
        assert sorted(j3["nodes"]) == ["n3", "n4"]

        # The job reads on its nodes at once, while the clone fills (and before every node has
        # had the heartbeat naming the clone): right bytes, all from peers.
        for node in j3["nodes"]:
            drop_page_cache()
            assert read_all(cluster.worker(node).mount, files) == []
        fill_done(cluster, "ds", "B")
        assert fault_proxy.count("GET") == 0  # the clone came from copy A, not the store
        clone_bytes = cached_on(cluster, "n3", "ds") + cached_on(cluster, "n4", "ds")
        assert clone_bytes == total_bytes(files)  # a whole second copy, once
        assert cached_on(cluster, "n1", "ds") + cached_on(cluster, "n2", "ds") == total_bytes(files)
        fill_events = [e for e in client.events("ds") if e["kind"] == "fill"]
        assert fill_events and fill_events[-1]["copied_bytes"] > 0

        # Both copies have room again; the job goes to the one covering most of its candidates.
        client.release_job("j1")
        placed = client.submit_job("j4", "ds", 2, candidates=["n2", "n3", "n4"])
        assert placed["copy"] == "B" and sorted(placed["nodes"]) == ["n3", "n4"]
        assert [row["in_copy"] for row in placed["ranking"]] == [True, True, False]
    finally:
        cluster.cleanup()


def test_tdcs_placement_prefers_the_copy_nodes_among_the_candidates(tmp_path, bucket, fault_proxy):
    cluster = start_cluster(tmp_path, 5)
    try:
        files = add(cluster, bucket, fault_proxy, nodes=["n1", "n2", "n3"])
        assert cluster.preload("ds")["state"] == "completed"
        wait_for(
            lambda: cluster.client.locality("ds")["cached_bytes"] == total_bytes(files),
            "locality of the preloaded copy",
        )
        job = cluster.client.submit_job("train", "ds", 3, candidates=["n2", "n3", "n4", "n5"])
        assert job["state"] == "running"
        assert sorted(job["nodes"][:2]) == ["n2", "n3"]
        assert job["nodes"][2] in ("n4", "n5")
        assert [row["in_copy"] for row in job["ranking"]] == [True, True, False, False]
    finally:
        cluster.cleanup()


# --- cleanup -------------------------------------------------------------------------------------


def test_ttl_frees_an_idle_copy_lock_never_and_the_reserve_stays(tmp_path, bucket, fault_proxy):
    cluster = start_cluster(tmp_path, 2, ram_reserve="256KiB")
    try:
        locked = add(cluster, bucket, fault_proxy, "ds", cleanup="lock")
        expiring = add(cluster, bucket, fault_proxy, "old", cleanup="ttl:4s")
        assert cluster.preload("ds")["state"] == "completed"  # first: it gets the reserve
        reserved_by_ds = {w.node: reserved_on(cluster, w.node) for w in cluster.workers}
        assert all(reserved_by_ds.values())
        assert cluster.preload("old")["state"] == "completed"
        reserved = {w.node: reserved_on(cluster, w.node) for w in cluster.workers}
        # Small blocks of "old" may have fitted in what "ds" left of the reserve: they stay.
        reserved_by_old = {node: reserved[node] - reserved_by_ds[node] for node in reserved}

        def only_the_reserve_left(node: str) -> bool:
            # The tiers count room in whole pages, cached bytes are the blocks' own sizes: what
            # stays of "old" is its reserved blocks, at most the reserve room they take.
            left = cached_on(cluster, node, "old")
            return left <= reserved_by_old[node] and (left > 0) == (reserved_by_old[node] > 0)

        def freed() -> bool:
            return all(only_the_reserve_left(node) for node in reserved) and any(
                e["kind"] == "freed" for e in cluster.client.events("old")
            )

        wait_for(freed, "ttl cleanup of old")
        assert any("ttl" in e["message"] for e in cluster.client.events("old"))
        # "ds" (lock) is whole, the reserve (its first blocks) untouched.
        assert sum(cached_on(cluster, w.node, "ds") for w in cluster.workers) == total_bytes(locked)
        assert {w.node: reserved_on(cluster, w.node) for w in cluster.workers} == reserved
        status = cluster.workers[0].status()
        assert status["cleanup"]["freed_bytes"]  # visible in the worker's status
        # The coordinator learns it from the workers' next heartbeats.
        wait_for(
            lambda: cluster.client.dataset("old")["freed_bytes"] > 0,
            "the coordinator to see the freed bytes",
        )
        metrics = httpx.get(f"{cluster.coordinator.url}/metrics").text
        assert re.search(r'cachefs_cache_used_ratio\{copy="A",dataset="old"\} [0-9.e-]+', metrics)

        fault_proxy.reset_counts()
        for worker in cluster.workers:
            drop_page_cache()
            assert read_all(worker.mount, locked, "ds") == []
            assert read_all(worker.mount, expiring, "old") == []
        gets = fault_proxy.count("GET")
        assert 0 < gets <= blocks_of(expiring)
        assert fault_proxy.count("GET", path_contains="/old/") == gets  # only the freed dataset
    finally:
        cluster.cleanup()


def test_lru_frees_the_older_dataset_first_and_keeps_the_reserve(tmp_path, bucket, fault_proxy):
    # One node whose RAM tier holds about two of the three datasets.
    _, datasets = bucket
    sizes = {name: total_bytes(files) for name, files in datasets.items()}
    capacity = sizes["old"] + sizes["new"] + sizes["ds"] * 7 // 10
    cluster = start_cluster(tmp_path, 1, ram=str(capacity), ram_reserve="256KiB")
    try:
        worker = cluster.workers[0]
        added = {
            name: add(cluster, bucket, fault_proxy, name, cleanup="lru")
            for name in ("old", "new", "ds")
        }
        drop_page_cache()
        assert read_all(worker.mount, added["old"], "old") == []  # first: it fills the reserve
        assert cached_on(cluster, "n1", "old") == sizes["old"]
        reserve_of_old = reserved_on(cluster, "n1")
        assert reserve_of_old > 0
        drop_page_cache()
        assert read_all(worker.mount, added["new"], "new") == []  # later
        drop_page_cache()
        assert read_all(worker.mount, added["ds"], "ds") == []  # fills the cache: pressure

        # What stays of "old" is its reserved blocks: at most the reserve's room (the tiers
        # count room in whole pages, cached bytes are the blocks' own sizes).
        wait_for(
            lambda: 0 < cached_on(cluster, "n1", "old") <= reserve_of_old,
            "lru cleanup of old",
        )
        # The reserve is never freed (a small block of another dataset may have taken what
        # "old" left of it).
        assert reserved_on(cluster, "n1") >= reserve_of_old
        assert cached_on(cluster, "n1", "new") == sizes["new"]  # the newer one stays
        assert any("least recently used" in e["message"] for e in cluster.client.events("old"))
        for name, files in added.items():
            drop_page_cache()
            assert read_all(worker.mount, files, name) == []
    finally:
        cluster.cleanup()


# --- scaling -------------------------------------------------------------------------------------


def test_scale_out_then_in_never_refetches_a_block(tmp_path, bucket, fault_proxy):
    cluster = start_cluster(tmp_path, 3)
    try:
        files = add(cluster, bucket, fault_proxy, nodes=["n1", "n2"])
        fault_proxy.reset_counts()
        assert cluster.preload("ds")["state"] == "completed"
        assert fault_proxy.count("GET") == blocks_of(files)
        client = cluster.client

        scaled = client.scale("ds", "A", add=["n3"])
        assert 0 < scaled["moved_shards"] < 1024
        for worker in cluster.workers:  # reads while the hand-off runs
            drop_page_cache()
            assert read_all(worker.mount, files) == []
        fill_done(cluster, "ds", "A")

        def spread_once() -> bool:
            held = [cached_on(cluster, w.node, "ds") for w in cluster.workers]
            return sum(held) == total_bytes(files) and all(held)

        wait_for(spread_once, "three owners, no duplicate after the trim")

        client.scale("ds", "A", remove=["n1"])
        for worker in cluster.workers:
            drop_page_cache()
            assert read_all(worker.mount, files) == []
        fill_done(cluster, "ds", "A")
        wait_for(lambda: cached_on(cluster, "n1", "ds") == 0, "n1 drops what it handed off")
        assert cached_on(cluster, "n2", "ds") + cached_on(cluster, "n3", "ds") == total_bytes(files)
        for worker in cluster.workers:
            drop_page_cache()
            assert read_all(worker.mount, files) == []
        assert fault_proxy.count("GET") == blocks_of(files)  # each block fetched once, ever
        kinds = [e["kind"] for e in client.events("ds")]
        assert kinds.count("scale") == 2 and kinds.count("fill") == 2
    finally:
        cluster.cleanup()
