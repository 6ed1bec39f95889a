"""The placement endpoint answering from *live* locality: a real cachefs worker process with a
partly cached dataset, and `python -m coordinator placement` reading it over the worker's
control socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from harness.processes import free_port
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT, WorkerProcess


def test_placement_uses_the_workers_live_cached_bytes(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for i in range(10):
        (source / f"f{i}.bin").write_bytes(bytes([i]) * 10_000)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--node", "gpu7")).start()
    port = free_port()
    server = None
    try:
        worker.add_dataset("imagenet", f"file://{source}")
        for i in range(4):  # cache 40 % of the dataset
            with open(worker.path("imagenet", f"f{i}.bin"), "rb") as f:
                f.read()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator",
                "placement",
                "--listen",
                f"127.0.0.1:{port}",
                "--worker-state",
                worker.state,
                "--gpus-per-node",
                "4",
            ],
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
            stderr=open(os.path.join(str(tmp_path), "placement.log"), "w"),  # noqa: SIM115
        )
        url = f"http://127.0.0.1:{port}/v1/placement"
        body = {"name": "train-1", "dataset": "imagenet", "gpus": 2, "policy": "tdcs"}
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                response = httpx.post(url, json=body, timeout=10)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "placement server did not start"
                time.sleep(0.1)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["decision"] == "place"
        assert answer["placement"] == [{"node": "gpu7", "gpus": 2}]
        assert answer["locality"]["cached_bytes"] == {"gpu7": 40_000}
        assert abs(answer["locality"]["cached_fraction"] - 0.4) < 1e-9
        unknown = httpx.post(url, json={**body, "dataset": "nope"}, timeout=10)
        assert unknown.status_code == 404
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        worker.cleanup()
