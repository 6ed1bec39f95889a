"""The distributed cache end to end: a real coordinator, three real workers on 127.0.0.2-4 (own
FUSE mount, state and RAM tier each), a real S3 endpoint (moto) behind the fault proxy, which
counts every GET the workers send to the store and injects faults. Every read is compared
byte for byte with the data that was uploaded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

import pytest

from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED, PEER_READS_SUPPORTED
from tests.cluster_process import Cluster, locality_settled, read_all, total_bytes, wait_for
from tests.e2e.fs.test_no_open import fuse_op_count
from tests.waiting import WAIT_S
from tests.worker_process import drop_page_cache

BLOCK = 256 << 10  # small blocks: multi-block files stay cheap


def _dataset_files() -> dict[str, bytes]:
    rng = random.Random(7)
    files = {}
    for cls in range(4):
        for i in range(20):
            files[f"train/c{cls}/img {i}.jpg"] = rng.randbytes(rng.randint(1, 120_000))
    files["train/big/shard-0.tfrecord"] = rng.randbytes(3 * BLOCK + 12345)  # 4 blocks
    files["train/big/empty"] = b""
    for i in range(10):
        files[f"val/v{i}.jpg"] = rng.randbytes(rng.randint(1000, 60_000))
    for i in range(4):
        files[f"flaky/bad-{i}.bin"] = rng.randbytes(50_000)
    return files


@pytest.fixture(scope="module")
def bucket(moto_s3):
    files = _dataset_files()
    name = moto_s3.make_bucket()
    for key, data in files.items():
        moto_s3.put(name, f"ds/{key}", data)
    return name, files


@pytest.fixture
def cluster(tmp_path, request):
    nodes = getattr(request, "param", 3)
    cluster = Cluster(str(tmp_path / "cluster"), nodes)
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


def add(cluster: Cluster, bucket, fault_proxy, name: str = "ds") -> dict[str, bytes]:
    bucket_name, files = bucket
    cluster.add_dataset(name, f"s3://{bucket_name}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
    return files


def test_preload_then_every_node_reads_everything_without_the_store(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    job = cluster.preload("ds")
    assert job["state"] == "completed", job
    assert job["objects_done"] == job["objects"] == len(files)
    assert job["bytes_done"] == job["bytes"] == total_bytes(files)
    assert job["failed_count"] == 0

    # No duplicates: every byte is cached once across the copy, spread over all three nodes.
    report = locality_settled(cluster, "ds", total_bytes(files))
    assert report["fraction"] == 1.0
    assert sum(row["cached_bytes"] for row in report["nodes"]) == total_bytes(files)
    assert all(row["cached_bytes"] > 0 for row in report["nodes"])
    assert {row["node"] for row in report["nodes"]} == {"n1", "n2", "n3"}
    per_node = {n["node"]: n for n in cluster.client.nodes()}
    assert per_node["n1"]["datasets"][0]["dataset"] == "ds"

    fault_proxy.reset_counts()
    directories = {"ds"} | {os.path.dirname(f"ds/{key}") for key in files} | {"ds/train"}
    for worker in cluster.workers:
        drop_page_cache()  # dentries too
        lookups = fuse_op_count(worker, "lookup")
        assert read_all(worker.mount, files) == []
        if FAST_READ_SUPPORTED:  # the preload prepared every file's LOOKUP reply, on each node
            assert fuse_op_count(worker, "lookup") - lookups <= len(directories)
    assert fault_proxy.count("GET") == 0  # every block came from a node's cache
    for worker in cluster.workers:
        status = worker.status()
        requests = status["peers"]["requests"]  # other nodes' shards: from peers
        assert requests.get("ok", 0) + requests.get("native_ok", 0) > 0
        assert status["peers"]["requests"].get("failed", 0) == 0
        assert status["reads"]["bytes_served"]["store"] == 0
        if FAST_READ_SUPPORTED:  # the owners answered from their native tables (every file
            # a preload fetched is registered there), each answer counted as served
            native = status["fuse_fast_read"]
            assert native["peer_answers"] > 0
            assert status["peers"]["blocks_served"] >= native["peer_answers"]
        if PEER_READS_SUPPORTED:  # ... and the readers sent other nodes' small files' READs
            # to them from C (the bytes were compared above), handing none back
            assert native["peer_reads"] > 0, native
            assert native["peer_handbacks"] == 0, native
            assert status["peers"]["requests"]["native_ok"] == native["peer_reads"]
    # Reading put nothing new in any cache: peer reads are not kept locally.
    locality_settled(cluster, "ds", total_bytes(files))


def test_reads_without_preload_fetch_each_block_from_the_store_once(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    fault_proxy.reset_counts()
    for worker in cluster.workers:
        drop_page_cache()
        assert read_all(worker.mount, files) == []
    blocks = sum(max(1, -(-len(d) // BLOCK)) for d in files.values() if d)
    assert fault_proxy.count("GET") == blocks  # the owner fetched each block; others read it
    locality_settled(cluster, "ds", total_bytes(files))


def _reader_loop(mount: str, files: dict[str, bytes], stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        out["problems"] += read_all(mount, files)
        out["rounds"] += 1


def _read_while(cluster: Cluster, files, readers, fault, heal, seconds: float = 4.0) -> list[dict]:
    """Readers loop over every file on ``readers`` (dropping the page cache so reads reach
    FUSE) while ``fault()`` happens; returns their tallies after ``heal()``."""
    stop = threading.Event()
    tallies = [{"problems": [], "rounds": 0} for _ in readers]
    threads = [
        threading.Thread(target=_reader_loop, args=(w.mount, files, stop, t))
        for w, t in zip(readers, tallies, strict=True)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        fault()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            drop_page_cache()
            time.sleep(0.5)
        rounds_during_fault = [t["rounds"] for t in tallies]
        # Every reader goes on to finish a whole round after the fault (a stuck reader fails
        # this wait; a slow machine only makes it longer).
        wait_for(
            lambda: all(
                t["rounds"] > before for t, before in zip(tallies, rounds_during_fault, strict=True)
            ),
            "every reader to finish a round after the fault",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=WAIT_S)
        heal()
    return tallies


def test_killed_worker_costs_readers_nothing_and_rejoins_warm(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    assert cluster.preload("ds")["state"] == "completed"
    victim = cluster.workers[2]
    cached_before = victim.dataset_status("ds")["cached_bytes"]
    assert cached_before > 0
    fault_proxy.reset_counts()
    tallies = _read_while(cluster, files, cluster.workers[:2], victim.kill9, lambda: None)
    assert [t["problems"] for t in tallies] == [[], []]
    assert fault_proxy.count("GET") > 0  # the dead node's blocks came from the store instead
    wait_for(lambda: cluster.client.node("n3")["state"] == "down", "n3 marked down")

    victim.start()
    wait_for(lambda: cluster.client.node("n3")["state"] == "up", "n3 back up")
    assert victim.dataset_status("ds")["cached_bytes"] >= cached_before  # warm from its index
    drop_page_cache()
    fault_proxy.reset_counts()
    assert read_all(victim.mount, files) == []


def test_stalled_worker_sigstop_costs_a_bounded_timeout(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    assert cluster.preload("ds")["state"] == "completed"
    victim = cluster.workers[2]
    tallies = _read_while(
        cluster,
        files,
        cluster.workers[:2],
        lambda: os.kill(victim.proc.pid, signal.SIGSTOP),
        lambda: os.kill(victim.proc.pid, signal.SIGCONT),
    )
    assert [t["problems"] for t in tallies] == [[], []]
    statuses = [w.status() for w in cluster.workers[:2]]
    # The stall was noticed (a timeout or the node marked down), never turned into an error.
    assert any(
        s["peers"]["requests"].get("failed", 0) + s["peers"]["requests"].get("cooling", 0)
        or s["reads"]["bytes_served"]["store"]
        for s in statuses
    )


def test_partitioned_worker_iptables_drop(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    assert cluster.preload("ds")["state"] == "completed"
    victim_ip = cluster.workers[2].address.split(":")[0]
    rule = ["INPUT", "-d", victim_ip, "-j", "DROP"]
    fault_proxy.reset_counts()
    tallies = _read_while(
        cluster,
        files,
        cluster.workers[:2],
        lambda: subprocess.run(["iptables", "-I", *rule], check=True),
        lambda: subprocess.run(["iptables", "-D", *rule], check=True),
    )
    assert [t["problems"] for t in tallies] == [[], []]
    assert fault_proxy.count("GET") > 0  # the unreachable node's blocks came from the store


@pytest.mark.parametrize("store", ["lmdb", "etcd"])
def test_coordinator_restart_during_preload(tmp_path, bucket, fault_proxy, request, store):
    location = request.getfixturevalue("etcd").location if store == "etcd" else None
    cluster = Cluster(str(tmp_path / "cluster"), 3, store=location).start()
    try:
        files = add(cluster, bucket, fault_proxy)
        fault_proxy.delay_next(60, 0.1, method="GET")  # a slow store: the preload takes a while
        cluster.client.preload("ds")
        wait_for(lambda: cluster.client.preload_status("ds")["bytes_done"] > 0, "progress")
        cluster.coordinator.kill9()
        # Reads never stop while the coordinator is down.
        drop_page_cache()
        assert read_all(cluster.workers[0].mount, files) == []
        cluster.coordinator.start()
        job = cluster.wait_preload("ds", timeout=120)
        assert job["state"] == "completed", job
        assert job["bytes_done"] == total_bytes(files)
        locality_settled(cluster, "ds", total_bytes(files))
    finally:
        cluster.cleanup()


def test_fraction_and_paths_select_what_they_say(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    job = cluster.preload("ds", paths=["val"])
    assert job["state"] == "completed"
    assert job["objects"] == 10 and job["bytes"] == total_bytes(files, "val/")
    locality_settled(cluster, "ds", total_bytes(files, "val/"))

    job = cluster.preload("ds", paths=["train"], fraction=0.3)
    assert job["state"] == "completed"
    train = total_bytes(files, "train/")
    # Within half a block of 30 % over the whole selection (each shard within one block).
    assert abs(job["bytes"] - 0.3 * train) <= BLOCK / 2
    assert 0 < job["objects"] < 82
    locality_settled(cluster, "ds", total_bytes(files, "val/") + job["bytes"])


def test_store_503_lists_failed_objects_and_resume_retries_them(cluster, bucket, fault_proxy):
    files = add(cluster, bucket, fault_proxy)
    fault_proxy.fail_matching("/flaky/", 503, method="GET")
    job = cluster.preload("ds", timeout=180)
    assert job["state"] == "failed"
    flaky = {k for k in files if k.startswith("flaky/")}
    assert {f["key"] for f in job["failed"]} == flaky
    assert job["failed_count"] == len(flaky)
    assert all("503" in f["reason"] or "SlowDown" in f["reason"] for f in job["failed"])
    assert job["objects_done"] == len(files) - len(flaky)

    fault_proxy.clear_faults()
    fault_proxy.reset_counts()
    cluster.client.resume_preload("ds")
    job = cluster.wait_preload("ds")
    assert job["state"] == "completed", job
    assert fault_proxy.count("GET") == len(flaky)  # cached blocks were skipped, not refetched
    locality_settled(cluster, "ds", total_bytes(files))
