"""A store that stalls 10 % of its GETs, read through a real FUSE mount: 0 failed reads.

A real `cachefs up` worker process, a real S3 HTTP endpoint (moto server) behind the fault proxy,
the dataset added with the real CLI (`cachefs dataset add --timeout --first-byte-timeout`). The
proxy holds a seeded random tenth of the object GETs for 20 s before answering them.

The numbers keep the proportions of the case this guards against (10 % of GETs stalling 40 s
under the default 60 s budget and 5 s first-byte timeout, where 1 read in 301 failed), halved
so that the test ends sooner: a 20 s stall, a 30 s budget, a 2.5 s first-byte timeout. A stall
is then two thirds of the budget, so two stalled tries in a row would still fail a read that
were not hedged or replaced.

No timing is asserted; the reads run 16 at a time and every wait is bounded generously.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.waiting import WAIT_S
from tests.worker_process import WorkerProcess

BLOCK = 64 * 1024
FILES = 200
STALL_FRACTION = 0.10
STALL_S = 20.0
BUDGET = "30s"
FIRST_BYTE_TIMEOUT = "2.5s"


def make_objects() -> dict[str, bytes]:
    """200 files of 1 byte to 3 blocks: about 400 block GETs."""
    rng = random.Random(11)
    return {
        f"train/{i // 50:02d}/{i:04d}.bin": rng.randbytes(rng.randint(1, 3 * BLOCK))
        for i in range(FILES)
    }


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def world(moto_s3, fault_proxy, tmp_path):
    bucket = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    objects = make_objects()
    for key, data in objects.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    worker = WorkerProcess(str(tmp_path), env=moto_s3.env).start()
    yield worker, bucket, objects
    fault_proxy.clear_faults()  # lets the held requests go
    worker.cleanup()


def cli(worker: WorkerProcess, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "cachefs", "--state", worker.state, *args],
        env=worker.env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def read_or_error(path: str) -> bytes | OSError:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        return exc


def test_ten_percent_of_gets_stalling_costs_no_read(world, fault_proxy):
    worker, bucket, objects = world
    cli(
        worker,
        "dataset",
        "add",
        "ds",
        f"s3://{bucket}/ds",
        "--endpoint",
        fault_proxy.url,
        "--block-size",
        str(BLOCK),
        "--timeout",
        BUDGET,
        "--first-byte-timeout",
        FIRST_BYTE_TIMEOUT,
    )
    (listed,) = json.loads(cli(worker, "dataset", "ls", "--json"))
    assert (listed["timeout_s"], listed["first_byte_timeout_s"]) == (30.0, 2.5)
    # Object GETs only (a listing is a GET of the bucket itself).
    fault_proxy.stall_fraction(STALL_FRACTION, STALL_S, path_contains=f"/{bucket}/ds/")

    paths = [worker.path("ds", key) for key in objects]
    with ThreadPoolExecutor(16) as pool:
        results = dict(zip(objects, pool.map(read_or_error, paths), strict=True))

    failed = {key: result for key, result in results.items() if isinstance(result, OSError)}
    assert not failed, (
        f"{len(failed)} of {len(objects)} reads failed, e.g. {next(iter(failed.items()))}"
    )
    wrong = [key for key, data in objects.items() if sha(results[key]) != sha(data)]
    assert not wrong, f"{len(wrong)} files read with wrong bytes, e.g. {wrong[:3]}"
    # The stalls did happen (about a tenth of some 400 GETs), and no GET failed in the worker.
    assert fault_proxy.stalled >= 10, fault_proxy.stalled
    store_requests = worker.status()["store"]["requests"]
    assert store_requests.get("get:ok", 0) > 0
    assert {outcome for outcome in store_requests if outcome.startswith("get:")} == {"get:ok"}
    assert os.path.ismount(worker.mount)
