"""Preload on a single node: `cachefs preload` run as a user runs it, against a real
`cachefs up` worker (no coordinator) serving a dataset from a real S3 endpoint (moto) behind
the fault proxy, which counts every GET the worker's fetcher processes and FUSE reads send to
the store and injects the faults. Every read through the mount is compared byte for byte with
what was uploaded. The last test runs the same command against a real coordinator and worker:
a selection that matches nothing is reported alike in both modes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from tests.cluster_process import Cluster, read_all, total_bytes
from tests.e2e.fs.test_no_open import fuse_op_count
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import REPO_ROOT, drop_page_cache, start_s3_world

BLOCK = 256 << 10  # small blocks: multi-block files stay cheap


def _dataset_files() -> dict[str, bytes]:
    rng = random.Random(11)
    files = {
        f"train/c{i % 3}/img {i}.jpg": rng.randbytes(rng.randint(1, 90_000)) for i in range(12)
    }
    files["train/big.tfrecord"] = rng.randbytes(3 * BLOCK + 4321)  # 4 blocks
    files["train/empty"] = b""
    for i in range(6):
        files[f"val/v{i}.jpg"] = rng.randbytes(rng.randint(1000, 40_000))
    for i in range(3):
        files[f"flaky/bad-{i}.bin"] = rng.randbytes(BLOCK + 1000)  # 2 blocks each
    return files


def blocks(files: dict[str, bytes]) -> int:
    """Store GETs that fetching these files takes: one per block (an empty file: none)."""
    return sum(-(-len(data) // BLOCK) for data in files.values())


def under(files: dict[str, bytes], prefix: str) -> dict[str, bytes]:
    return {key: data for key, data in files.items() if key.startswith(prefix)}


@pytest.fixture
def world(tmp_path, moto_s3, fault_proxy):
    world = start_s3_world(
        moto_s3, fault_proxy, str(tmp_path / "w"), _dataset_files(), block_size=BLOCK
    )
    try:
        yield world
    finally:
        world.worker.cleanup()


def cachefs(state: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in single-node mode: no coordinator configured, the worker found by its state."""
    base = {
        k: v for k, v in os.environ.items() if k not in ("CACHEFS_COORDINATOR", "CACHEFS_TOKEN")
    }
    return subprocess.run(
        [sys.executable, "-m", "cachefs", *args],
        env={**base, "CACHEFS_STATE": state, "PYTHONPATH": REPO_ROOT, **(env or {})},
        capture_output=True,
        text=True,
        timeout=WAIT_S + 60,
    )


def preload(world, *args: str) -> subprocess.CompletedProcess:
    return cachefs(world.worker.state, "preload", *args)


def status(world) -> dict:
    result = preload(world, "status", "ds", "--json")
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def object_gets(world, prefix: str = "") -> int:
    """GETs of the dataset's objects (not its listing) that reached the store."""
    return world.proxy.count("GET", path_contains=f"/{world.bucket}/ds/{prefix}")


def fetcher_processes(worker_pid: int) -> int:
    """Descendants of the worker started through multiprocessing's forkserver: the server
    and the fetcher processes it forked."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
        except (ValueError, OSError):
            continue  # not a process, or gone
    found = 0
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, worker_pid):
            ancestor = parents.get(ancestor)
        if ancestor == worker_pid:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found += b"forkserver" in f.read()
            except OSError:
                continue
    return found


def warnings(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "warning" in line]


def test_preload_of_a_prefix_then_reads_through_the_mount_make_no_store_gets(world):
    train = under(world.objects, "train/")
    world.proxy.reset_counts()
    done = preload(world, "ds", "--paths", "train/", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout and f"{len(train)}/{len(train)} objects" in done.stdout
    assert warnings(done) == []
    assert object_gets(world) == blocks(train)  # each selected block fetched once, nothing else
    # Fetched by the fetcher processes (a forkserver and its children), not the FUSE process.
    assert fetcher_processes(world.worker.proc.pid) >= 2

    job = status(world)
    assert job["state"] == "completed"
    assert job["objects_done"] == job["objects"] == len(train)
    assert job["bytes_done"] == job["bytes"] == total_bytes(train)
    assert job["failed_count"] == 0 and job["unmatched_paths"] == []
    assert job["rate_bytes_per_s"] > 0 and job["eta_s"] is None
    assert world.worker.dataset_status("ds")["cached_bytes"] == total_bytes(train)

    world.proxy.reset_counts()
    drop_page_cache()
    assert read_all(world.worker.mount, train) == []
    assert object_gets(world) == 0
    # The count counts: a file the preload did not select comes from the store.
    assert read_all(world.worker.mount, under(world.objects, "val/v0")) == []
    assert object_gets(world, "val/v0.jpg") >= 1


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="stock pyfuse3: no native path to prepare")
def test_files_just_preloaded_are_first_read_without_python(world):
    """The preload leaves each file's LOOKUP reply and blocks in the native table: reading the
    files by path with every dentry dropped (a job reading a file list) costs Python only the
    LOOKUPs of the directories on the way, and not one READ."""
    train = under(world.objects, "train/")
    done = preload(world, "ds", "--paths", "train/", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    drop_page_cache()  # dentries too
    worker = world.worker
    lookups, reads = fuse_op_count(worker, "lookup"), fuse_op_count(worker, "read")
    native_before = worker.status()["fuse_fast_read"]
    assert read_all(worker.mount, train) == []  # byte for byte, by path
    native_after = worker.status()["fuse_fast_read"]
    directories = {"ds"} | {os.path.dirname(f"ds/{key}") for key in train}
    assert fuse_op_count(worker, "lookup") - lookups <= len(directories | {"ds/train"})
    assert fuse_op_count(worker, "read") == reads
    assert native_after["lookups"] - native_before["lookups"] == len(train)
    assert native_after["reads"] > native_before["reads"]


def test_a_refresh_or_removal_after_the_preload_forgets_what_it_prepared(world, moto_s3):
    """The prepared LOOKUP replies and blocks follow a LOOKUP's rules: a file changed in the
    store and refreshed shows its new bytes and size, a removed dataset's files are gone."""
    train = under(world.objects, "train/")
    done = preload(world, "ds", "--paths", "train/", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    changed = "train/c0/img 0.jpg"
    new_bytes = random.Random(3).randbytes(len(train[changed]) + 777)
    moto_s3.put(world.bucket, f"ds/{changed}", new_bytes)
    world.worker.client.refresh_dataset("ds")
    drop_page_cache()
    assert read_all(world.worker.mount, {**train, changed: new_bytes}) == []
    assert os.stat(os.path.join(world.worker.mount, "ds", changed)).st_size == len(new_bytes)

    # A directory held open keeps its inode: a LOOKUP under it after the removal reaches the
    # worker (not stopped at the mount root), and must not find the prepared reply.
    held = os.open(os.path.join(world.worker.mount, "ds", "train", "c0"), os.O_RDONLY)
    try:
        world.worker.client.remove_dataset("ds")
        drop_page_cache()
        with pytest.raises(FileNotFoundError):
            os.stat("img 0.jpg", dir_fd=held)
    finally:
        os.close(held)
    for key in train:
        assert not os.path.exists(os.path.join(world.worker.mount, "ds", key)), key


def test_fraction_and_byte_budget_select_that_share_of_the_bytes(world):
    everything = total_bytes(world.objects)
    half = preload(world, "ds", "--fraction", "0.5", "--wait", "--json")
    assert half.returncode == 0, half.stderr
    job = json.loads(half.stdout)
    assert job["state"] == "completed" and job["bytes_done"] == job["bytes"]
    assert abs(job["bytes"] - 0.5 * everything) <= BLOCK / 2  # the planner's promise
    assert 0 < job["objects"] < len(world.objects)
    assert world.worker.dataset_status("ds")["cached_bytes"] == job["bytes"]

    world.proxy.reset_counts()
    rest = preload(world, "ds", "--bytes", str(everything), "--wait", "--json")
    assert rest.returncode == 0, rest.stderr
    job = json.loads(rest.stdout)
    assert job["state"] == "completed" and job["bytes"] == everything
    assert world.worker.dataset_status("ds")["cached_bytes"] == everything
    assert 0 < object_gets(world) < blocks(world.objects)  # the first half was not fetched again


def test_failed_objects_are_listed_and_resume_fetches_only_them(world):
    flaky = under(world.objects, "flaky/")
    world.proxy.fail_matching("/ds/flaky/", 503, method="GET")
    failed = preload(world, "ds", "--wait")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    for key in flaky:
        assert f"failed: {key} " in failed.stdout
    job = status(world)
    assert job["state"] == "failed" and job["failed_count"] == len(flaky)
    assert {failure["key"] for failure in job["failed"]} == set(flaky)
    assert all("503" in f["reason"] or "SlowDown" in f["reason"] for f in job["failed"])
    assert job["objects_done"] == len(world.objects) - len(flaky)

    world.proxy.clear_faults()
    world.proxy.reset_counts()
    resumed = preload(world, "resume", "ds", "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "completed" in resumed.stdout
    assert status(world)["id"] != job["id"]  # a new job with the same selection
    assert object_gets(world) == object_gets(world, "flaky/") == blocks(flaky)

    world.proxy.reset_counts()
    drop_page_cache()
    assert read_all(world.worker.mount, world.objects) == []
    assert object_gets(world) == 0


def store_gets_counted(world) -> dict[str, float]:
    """The worker's ``cachefs_store_requests_total`` for GETs, by outcome."""
    counted = {}
    for family in text_string_to_metric_families(world.worker.client.metrics()):
        for sample in family.samples:
            if sample.name == "cachefs_store_requests_total" and sample.labels["op"] == "get":
                counted[sample.labels["outcome"]] = sample.value
    return counted


def test_the_preloads_gets_count_in_the_workers_store_requests_by_outcome(world):
    """The fetcher processes' GETs count in the worker's metrics as the read path's do: one
    per block fetched, and every refused one under its error's class — as many as reached the
    store (a flaky object fails at its first refused block; blocks of it already asked for are
    refused too). Nothing is read through the mount here."""
    flaky = under(world.objects, "flaky/")
    world.proxy.fail_matching("/ds/flaky/", 403, code="AccessDenied", method="GET")
    done = preload(world, "ds", "--wait")
    assert done.returncode == 1, done.stdout + done.stderr
    assert status(world)["failed_count"] == len(flaky)
    fetched = blocks({key: data for key, data in world.objects.items() if key not in flaky})
    refused = object_gets(world, "flaky/")
    assert refused >= len(flaky)
    assert store_gets_counted(world) == {"ok": fetched, "StoreAuthError": refused}
    assert fetched + refused == object_gets(world)


def test_cancel_exits_0_and_resume_finishes_what_it_left(world):
    world.proxy.blackhole(method="GET", path_contains=f"/{world.bucket}/ds/")  # a hung store
    started = preload(world, "ds")
    assert started.returncode == 0 and " running: everything" in started.stdout, started.stderr
    wait_for(lambda: object_gets(world) > 0, "the preload's first GET")

    cancelled = preload(world, "cancel", "ds")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert ": cancelled" in cancelled.stdout
    shown = preload(world, "status", "ds")
    assert ": cancelled" in shown.stdout
    assert shown.returncode == 1  # not everything was preloaded
    assert status(world)["state"] == "cancelled"

    world.proxy.clear_faults()
    resumed = preload(world, "resume", "ds", "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    job = status(world)
    assert job["state"] == "completed" and job["objects_done"] == len(world.objects)
    world.proxy.reset_counts()
    drop_page_cache()
    assert read_all(world.worker.mount, world.objects) == []
    assert object_gets(world) == 0


def test_a_selection_matching_nothing_warns_in_one_line_and_exits_3(world):
    typo = preload(world, "ds", "--paths", "trian/")
    assert typo.returncode == 3, typo.stdout + typo.stderr  # known at once on a single node
    [line] = warnings(typo)
    assert "trian/" in line and "matches no file of dataset 'ds'" in line
    waited = preload(world, "ds", "--paths", "trian/", "--wait")
    assert waited.returncode == 3 and len(warnings(waited)) == 1
    assert "0/0 objects" in waited.stdout
    shown = preload(world, "status", "ds")
    assert shown.returncode == 3 and len(warnings(shown)) == 1

    partly = preload(world, "ds", "--paths", "val,vall", "--wait")
    assert partly.returncode == 0, partly.stdout + partly.stderr
    [line] = warnings(partly)
    assert "vall matches nothing in dataset 'ds'" in line
    job = status(world)
    assert job["objects_done"] == len(under(world.objects, "val/"))
    assert job["unmatched_paths"] == ["vall"]

    bad = preload(world, "ds", "--fraction", "1.5")
    assert bad.returncode == 1 and "fraction" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    missing = preload(world, "status", "nope")
    assert missing.returncode == 1 and "no dataset named 'nope'" in missing.stderr


def test_jobs_survive_a_worker_restart(world):
    """A scheduled job (--at) keeps its time, a running one carries on by itself."""
    later = preload(world, "ds", "--paths", "val", "--at", str(int(time.time()) + 3600))
    assert later.returncode == 0 and " scheduled: val, from " in later.stdout, later.stderr
    world.worker.restart()
    job = status(world)
    assert job["state"] == "scheduled" and job["selection"]["paths"] == ["val"]
    assert preload(world, "cancel", "ds").returncode == 0

    world.proxy.blackhole(method="GET", path_contains=f"/{world.bucket}/ds/")
    running = preload(world, "ds")
    assert running.returncode == 0, running.stderr
    wait_for(lambda: object_gets(world) > 0, "the preload's first GET")
    job_id = status(world)["id"]
    world.worker.stop()  # `cachefs down` while the store hangs: the job is still running
    world.proxy.clear_faults()
    world.worker.start()
    waited = preload(world, "status", "ds", "--wait", "--json")
    assert waited.returncode == 0, waited.stderr
    job = json.loads(waited.stdout)
    assert job["id"] == job_id and job["state"] == "completed"
    assert job["objects_done"] == len(world.objects)
    world.proxy.reset_counts()
    drop_page_cache()
    assert read_all(world.worker.mount, world.objects) == []
    assert object_gets(world) == 0

    # A jobs file that cannot be read costs the jobs it held, never the worker.
    world.worker.stop()
    with open(os.path.join(world.worker.state, "preloads.json"), "w") as f:
        f.write("{not json")
    world.worker.start()
    forgotten = preload(world, "status", "ds")
    assert forgotten.returncode == 1 and "has no preload job" in forgotten.stderr
    assert preload(world, "ds", "--paths", "val", "--wait").returncode == 0


def test_cluster_preload_matching_nothing_warns_alike_and_workers_refuse_local_preload(tmp_path):
    cluster = Cluster(str(tmp_path / "cluster"), 1).start()
    source = tmp_path / "source"
    (source / "train").mkdir(parents=True)
    (source / "train" / "a.bin").write_bytes(b"a" * 1000)
    try:
        cluster.add_dataset("ds", f"file://{source}")
        env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
        state = cluster.workers[0].state
        typo = cachefs(state, "preload", "ds", "--paths", "trian", "--wait", env=env)
        assert typo.returncode == 3, typo.stdout + typo.stderr
        [line] = warnings(typo)
        assert "trian" in line and "matches no file of dataset 'ds'" in line
        done = cachefs(state, "preload", "ds", "--wait", env=env)
        assert done.returncode == 0 and warnings(done) == [], done.stdout + done.stderr

        local = cachefs(state, "preload", "status", "ds")  # no coordinator given: the worker
        assert local.returncode == 1 and "follows the coordinator" in local.stderr
    finally:
        cluster.cleanup()
