"""An OSS dataset through the mount, end to end: a real worker process and FUSE mount over the
local OSS-protocol server of tests/fakes/oss_server.py (no OSS-compatible server can run here —
no network and no Alibaba binary — so that fake speaks the real HTTP protocol subset oss2 uses
and verifies its request signatures)."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from cachefs.client import ControlError
from tests.worker_process import WorkerProcess, drop_page_cache


def test_oss_dataset_reads_byte_exact_and_bad_credentials_are_named(oss_server, tmp_path):
    rng = random.Random(11)
    objects = {f"imgs/c{i % 3}/f{i}.jpg": rng.randbytes(rng.randint(0, 300_000)) for i in range(12)}
    oss_server.create_bucket("train-data")
    for key, data in objects.items():
        oss_server.put("train-data", key, data)
    wrong = {**oss_server.env, "OSS_ACCESS_KEY_SECRET": "definitely-wrong-secret"}
    worker = WorkerProcess(str(tmp_path / "bad"), env=wrong).start()
    try:
        with pytest.raises(ControlError) as info:
            worker.add_dataset("ds", "oss://train-data/imgs", endpoint=oss_server.endpoint)
        message = str(info.value)
        assert "ds" in message and "credentials" in message.lower()
        assert "definitely-wrong-secret" not in message
        assert worker.client.datasets() == []
    finally:
        worker.cleanup()

    worker = WorkerProcess(str(tmp_path / "good"), env=oss_server.env).start()
    try:
        with pytest.raises(ControlError) as info:
            worker.add_dataset("nob", "oss://no-such-bucket/x", endpoint=oss_server.endpoint)
        assert "no-such-bucket" in str(info.value)
        added = worker.add_dataset(
            "ds", "oss://train-data/imgs", endpoint=oss_server.endpoint, block_size=64 * 1024
        )
        assert added["files"] == len(objects)
        for _ in range(2):
            for key, data in objects.items():
                path = worker.path("ds", key.removeprefix("imgs/"))
                with open(path, "rb") as f:
                    assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
            drop_page_cache()
        assert worker.dataset_status("ds")["cached_fraction"] == 1.0
        assert sorted(os.listdir(worker.path("ds"))) == ["c0", "c1", "c2"]
    finally:
        worker.cleanup()
