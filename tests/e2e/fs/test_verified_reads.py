"""Every byte read through the mount is verified: a cached block changed in place on disk after
it was read is refetched from the store, and the reader gets the right bytes.

Real parts: a `cachefs up` worker process with its FUSE mount, a RAM tier on tmpfs or an SSD tier
on disk, an S3 endpoint (moto server) behind the fault proxy that counts the store's GETs, and
the `cachefs status` command.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid

import pytest

from tests.damage import flip_byte
from tests.worker_process import REPO_ROOT, WorkerProcess, drop_page_cache

BLOCK = 1 << 20  # eight 128 KiB FUSE reads per block
KEY = "train/shard-0.tfrecord"


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(params=["ram", "ssd"])
def world(request, moto_s3, fault_proxy, tmp_path):
    """A worker serving one 2.3-block object whose blocks are cached in the tier under test."""
    tier = request.param
    data = random.Random(15).randbytes(2 * BLOCK + 300_000)
    bucket = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    moto_s3.put(bucket, f"ds/{KEY}", data)
    ssd_dir = str(tmp_path / "ssd")
    options = {"ram": "0", "ssd": f"{ssd_dir}:64MiB"} if tier == "ssd" else {}
    worker = WorkerProcess(str(tmp_path / "worker"), env=moto_s3.env, **options).start()
    try:
        worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        yield worker, fault_proxy, data, worker.ram_dir if tier == "ram" else ssd_dir
    finally:
        worker.cleanup()


def cli_status(worker: WorkerProcess) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "cachefs", "--state", worker.state, "status", "--json"],
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_a_block_changed_on_disk_after_it_was_read_is_refetched_never_served(world):
    worker, proxy, data, tier_dir = world
    path = worker.path("ds", KEY)
    assert read_file(path) == data  # fetched from the store and admitted
    gets = proxy.count("GET")
    drop_page_cache()
    assert read_file(path) == data  # served from the tier: 128 KiB reads of cached blocks
    assert proxy.count("GET") == gets

    block_file = worker.client.resolve("ds", KEY)["blocks"][1]["file"]
    assert block_file.startswith(tier_dir + "/")
    damaged_at = 200_000  # inside block 1, in its second 128 KiB chunk
    flip_byte(block_file, damaged_at)
    drop_page_cache()

    with open(path, "rb", buffering=0) as f:  # one FUSE read, of the damaged chunk only
        offset = BLOCK + damaged_at - 100
        assert os.pread(f.fileno(), 4096, offset) == data[offset : offset + 4096]
    assert proxy.count("GET") == gets + 1  # block 1 refetched
    assert worker.status()["cache"]["corrupt"] == 1
    drop_page_cache()
    assert read_file(path) == data  # every byte, from the block admitted again
    assert proxy.count("GET") == gets + 1
    status = cli_status(worker)
    assert status["cache"]["corrupt"] == 1
    assert status["tiers"][0 if tier_dir == worker.ram_dir else 1]["blocks"] == 3
