"""Scale and clone hand-offs of several datasets, and a preload started right after `dataset
add`, end to end: a real coordinator and three real workers (own FUSE mount, state and RAM tier
each, on 127.0.0.2-4), driven with the `cachefs` CLI a user runs, over a real S3 endpoint
(moto) behind the fault proxy, which counts every GET the workers send to the store. Every
read is compared byte for byte with what was uploaded.

What these guard:
- a hand-off's trims reach the tables of every process serving a mount (``--fuse-processes``)
  before the space is released: readers through both mounts see no error, no wrong byte;
- fill ids are numbered per dataset ("A-1" for the first scale of every dataset): a node that
  ran one dataset's "A-1" must still run the next dataset's, and the old owner must not drop
  what the new owner never copied;
- a scale started as soon as the previous one ended (its trims still pending) loses no block;
- `cachefs preload b --wait` right after `cachefs dataset add b …` completes.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from cachefs.fs.fuse_ops import CLONES_SUPPORTED
from tests.cluster_process import Cluster, read_all, total_bytes, wait_for
from tests.waiting import WAIT_S
from tests.worker_process import GENEROUS_STORE_BUDGET, drop_page_cache

BLOCK = 256 << 10
DATASETS = ("a", "b")


def make_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 3}/f{i}.bin": rng.randbytes(rng.randint(1, 150_000)) for i in range(30)}
    files["big/blob"] = rng.randbytes(3 * BLOCK + 4321)  # four blocks
    return files


def blocks_of(files: dict[str, bytes]) -> int:
    return sum(-(-len(data) // BLOCK) for data in files.values())


@pytest.fixture(scope="module")
def bucket(moto_s3):
    name = moto_s3.make_bucket()
    datasets = {dataset: make_files(seed) for seed, dataset in enumerate(DATASETS)}
    for dataset, files in datasets.items():
        for key, data in files.items():
            moto_s3.put(name, f"{dataset}/{key}", data)
    return name, datasets


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(str(tmp_path / "cluster"), 3)
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


def cachefs(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    """The `cachefs` CLI against the cluster's coordinator (as a user runs it)."""
    env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
    done = subprocess.run(
        [sys.executable, "-m", "cachefs", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, f"cachefs {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def add_dataset(cluster: Cluster, bucket_name: str, fault_proxy, name: str, *options: str) -> None:
    """Through the CLI, with the tests' generous store budget (no hedge to spoil GET counts)."""
    cachefs(
        cluster, "dataset", "add", name, f"s3://{bucket_name}/{name}", "--endpoint",
        fault_proxy.url, "--block-size", str(BLOCK),
        "--timeout", f"{GENEROUS_STORE_BUDGET['timeout_s']:g}s",
        "--first-byte-timeout", f"{GENEROUS_STORE_BUDGET['first_byte_timeout_s']:g}s", *options,
    )  # fmt: skip


def copy_of(cluster: Cluster, dataset: str, copy_id: str) -> dict:
    return next(c for c in cluster.client.dataset(dataset)["copies"] if c["id"] == copy_id)


def wait_fill_done(cluster: Cluster, dataset: str, copy_id: str) -> None:
    wait_for(lambda: copy_of(cluster, dataset, copy_id)["fill"] is None, f"fill of {dataset}")


def cached_on(cluster: Cluster, node: str, dataset: str) -> int:
    """The node's own count of its cached bytes of ``dataset`` (its `cachefs status`)."""
    return cluster.worker(node).dataset_status(dataset)["cached_bytes"]


def wait_held(cluster: Cluster, dataset: str, expected: dict[str, int]) -> None:
    """Until each node holds exactly its expected bytes of ``dataset`` (trims are tasks)."""

    def held() -> bool:
        return all(cached_on(cluster, node, dataset) == n for node, n in expected.items())

    wait_for(held, f"{dataset} held as {expected}")


def fill_events(cluster: Cluster, dataset: str) -> list[dict]:
    return [e for e in cluster.client.events(dataset) if e["kind"] == "fill"]


def test_two_datasets_scaled_and_cloned_back_to_back_keep_every_cached_byte(
    cluster, bucket, fault_proxy
):
    bucket_name, datasets = bucket
    sizes = {name: total_bytes(files) for name, files in datasets.items()}
    for name in DATASETS:  # copy A on n1; a third job over one per copy gets a clone
        add_dataset(
            cluster, bucket_name, fault_proxy, name, "--nodes", "n1",
            "--max-jobs-per-copy", "1", "--overflow", "clone",
        )  # fmt: skip
    fault_proxy.reset_counts()
    for name in DATASETS:
        cachefs(cluster, "preload", name, "--wait")
    for name, files in datasets.items():
        assert fault_proxy.count("GET", path_contains=f"/{bucket_name}/{name}/") == blocks_of(files)
    for name in DATASETS:
        wait_held(cluster, name, {"n1": sizes[name], "n2": 0, "n3": 0})

    # Scale out, both datasets back to back: both fills are "A-1" (and reach n2 in one view).
    for name in DATASETS:
        scaled = cachefs(cluster, "scale", name, "--copy", "A", "--add", "n2")
        assert "handed off" in scaled.stdout
    for name in DATASETS:
        wait_fill_done(cluster, name, "A")
    # ... and back in as soon as each hand-off is over, its trims possibly still pending.
    for name in DATASETS:
        cachefs(cluster, "scale", name, "--copy", "A", "--remove", "n2")
    for name in DATASETS:
        wait_fill_done(cluster, name, "A")
        # Every byte is still cached, once: on n1, which owns everything again.
        wait_held(cluster, name, {"n1": sizes[name], "n2": 0, "n3": 0})
        assert copy_of(cluster, name, "A")["handed_off"] == {}
        events = fill_events(cluster, name)
        assert len(events) == 2
        # The scale-out copied what moved to n2. (The scale-in may copy nothing: n1 still holds
        # what it handed off if its trim had not run yet when the second scale came.)
        assert events[0]["copied_bytes"] > 0, events
        assert all(e["absent_blocks"] == e["failed_blocks"] == 0 for e in events), events

    # Clone both datasets back to back onto the same worker, n3: fills "B-3" of each.
    for name in DATASETS:
        first = cachefs(cluster, "job", "submit", f"{name}-1", "--dataset", name)
        assert first.stdout.startswith(f"{name}-1: running on n1 (copy A)")
        second = cachefs(
            cluster, "job", "submit", f"{name}-2", "--dataset", name, "--candidates", "n3"
        )
        assert second.stdout.startswith(f"{name}-2: running on n3 (a new copy B)")
    for name in DATASETS:
        wait_fill_done(cluster, name, "B")
        last = fill_events(cluster, name)[-1]
        assert (last["copied_bytes"], last["absent_blocks"], last["failed_blocks"]) == (
            sizes[name],
            0,
            0,
        )

    # 100 % of each dataset on each copy: the workers' own accounting and the coordinator's.
    expected = {name: {"n1": sizes[name], "n3": sizes[name]} for name in DATASETS}
    for name in DATASETS:
        wait_held(cluster, name, {**expected[name], "n2": 0})

        def located(name: str = name) -> dict[str, int]:
            rows = cluster.client.locality(name)["nodes"]
            return {row["node"]: row["cached_bytes"] for row in rows if row["cached_bytes"]}

        wait_for(lambda name=name: located(name) == expected[name], f"the locality of {name}")
    # ... and byte for byte, from every node, without a single store GET.
    fault_proxy.reset_counts()
    for worker in cluster.workers:
        for name, files in datasets.items():
            drop_page_cache()
            assert read_all(worker.mount, files, name) == [], (worker.node, name)
    assert fault_proxy.count("GET") == 0


def test_preload_right_after_dataset_add_completes_on_three_workers(cluster, bucket, fault_proxy):
    """`cachefs preload b --wait` right after `cachefs dataset add b …`: the preload job reaches
    the workers before they have opened the dataset (a large listing takes minutes). Here the
    workers' listings are held at the store until every worker has the job, then let go; the
    preload must then plan every shard and complete. (The dataset is added through the API,
    with the body `cachefs dataset add` sends: the CLI's own listing check would be held too.)
    """
    bucket_name, datasets = bucket
    files = datasets["b"]
    fault_proxy.reset_counts()
    fault_proxy.blackhole(method="GET")  # no answer until cleared (then the client retries)
    cluster.client.add_dataset(
        {"name": "b", "uri": f"s3://{bucket_name}/b", "endpoint": fault_proxy.url,
         "block_size": BLOCK, **GENEROUS_STORE_BUDGET}
    )  # fmt: skip
    env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
    preload = subprocess.Popen(
        [sys.executable, "-m", "cachefs", "preload", "b", "--wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: all("not served here yet" in worker.log() for worker in cluster.workers),
            "the preload job on every worker, before its dataset",
        )
        fault_proxy.clear_faults()
        out, err = preload.communicate(timeout=WAIT_S)
    finally:
        if preload.poll() is None:
            preload.kill()
            preload.communicate()
    assert preload.returncode == 0, out + err
    assert "completed" in out, out + err
    job = cluster.client.preload_status("b")
    assert job["state"] == "completed"
    assert job["objects_done"] == job["objects"] == len(files)
    assert job["bytes_done"] == job["bytes"] == total_bytes(files)
    # Each block once, by its owner (the listings are GETs too: counted apart).
    assert fault_proxy.count("GET", path_contains=f"/{bucket_name}/b/") == blocks_of(files)
    wait_for(
        lambda: cluster.client.locality("b")["cached_bytes"] == total_bytes(files),
        "the preloaded bytes in the locality API",
    )
    fault_proxy.reset_counts()
    for worker in cluster.workers:
        drop_page_cache()
        assert read_all(worker.mount, files, "b") == []
    assert fault_proxy.count("GET") == 0


@pytest.mark.skipif(not CLONES_SUPPORTED, reason="needs the patched pyfuse3 (--fuse-processes)")
def test_a_hand_off_while_serving_processes_read_loses_no_byte(tmp_path, bucket, fault_proxy):
    """Two workers each serving its mount with two processes (``--fuse-processes 2``,
    cachefs/fs/serving.py): a copy on n1 is scaled out to n2 and back while 8 readers read
    through both mounts. The trims of every hand-off reach each serving process's table before
    the blocks' space is released, so no reader gets an error or a wrong byte, and afterwards
    both mounts serve every byte again."""
    bucket_name, datasets = bucket
    files = datasets["a"]
    cluster = Cluster(str(tmp_path / "cluster"), 2, worker_args=("--fuse-processes", "2"))
    try:
        cluster.start()
        add_dataset(cluster, bucket_name, fault_proxy, "a", "--nodes", "n1")
        cachefs(cluster, "preload", "a", "--wait")
        wait_held(cluster, "a", {"n1": total_bytes(files), "n2": 0})
        problems: list[str] = []
        stop = threading.Event()
        rounds = [0]

        def reader(mount: str) -> None:
            while not stop.is_set():
                drop_page_cache()
                problems.extend(read_all(mount, files, "a"))
                rounds[0] += 1

        readers = [
            threading.Thread(target=reader, args=(worker.mount,))
            for worker in cluster.workers
            for _ in range(4)
        ]
        for thread in readers:
            thread.start()
        try:
            for change in ("--add", "--remove"):
                cachefs(cluster, "scale", "a", "--copy", "A", change, "n2")
                wait_fill_done(cluster, "a", "A")
                target = rounds[0] + len(readers)
                wait_for(lambda t=target: rounds[0] >= t, "every reader through the files again")
        finally:
            stop.set()
            for thread in readers:
                thread.join(WAIT_S)
        assert problems == []
        wait_held(cluster, "a", {"n1": total_bytes(files), "n2": 0})
        for worker in cluster.workers:
            figures = worker.status()["fuse_processes"]
            assert len(figures["pids"]) == 1 and figures["deaths"] == 0
            drop_page_cache()
            assert read_all(worker.mount, files, "a") == []
    finally:
        cluster.cleanup()
