"""A real cluster for integration tests: a `cachefs coordinator` process and `cachefs worker`
processes, each "node" on its own loopback address (127.0.0.2, .3, …) with its own state dir,
RAM-tier dir and FUSE mount. Started with the same CLI a user runs."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import httpx

from cachefs.client import CoordinatorClient
from tests.fakes.moto import free_port
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import GENEROUS_STORE_BUDGET, REPO_ROOT, WorkerProcess, log_tail

TOKEN = "test-token-0123456789"
HEARTBEAT = "0.3s"
DOWN_AFTER = "1.5s"


class CoordinatorProcess:
    def __init__(
        self,
        base_dir: str,
        *,
        store: str | None = None,
        env: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.base_dir = base_dir
        self.extra_args = extra_args
        self.state = os.path.join(base_dir, "coordinator")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store
        self.env = {**os.environ, **(env or {}), "CACHEFS_TOKEN": TOKEN}
        self.env["PYTHONPATH"] = REPO_ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(base_dir, "coordinator.log")
        self.client = CoordinatorClient(self.url, TOKEN, timeout=30)

    def start(self, timeout: float = WAIT_S) -> CoordinatorProcess:
        os.makedirs(self.base_dir, exist_ok=True)
        args = [
            sys.executable, "-m", "cachefs", "coordinator", "--state", self.state,
            "--listen", f"127.0.0.1:{self.port}",
            "--heartbeat-interval", HEARTBEAT, "--down-after", DOWN_AFTER,
        ]  # fmt: skip
        if self.store:
            args += ["--store", self.store]
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"coordinator did not come up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return log_tail(self.log_path)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        self.client.close()


class ClusterWorker(WorkerProcess):
    """`cachefs worker` on its own loopback address."""

    def __init__(
        self,
        base_dir: str,
        node: str,
        address: str,
        coordinator: CoordinatorProcess,
        *,
        ram: str = "256MiB",
        ram_reserve: str = "0",
        peer_timeout: str = "1s",
        env: dict | None = None,
    ):
        self.node = node
        self.address = address
        super().__init__(
            base_dir,
            ram=ram,
            ram_reserve=ram_reserve,
            env={**(env or {}), "CACHEFS_TOKEN": TOKEN},
            command=(
                "worker", "--coordinator", coordinator.url, "--node", node,
                "--listen", address, "--heartbeat-interval", HEARTBEAT,
                "--peer-timeout", peer_timeout, "--preload-processes", "1",
            ),
        )  # fmt: skip


class Cluster:
    """A coordinator and ``nodes`` workers named n1…nN on 127.0.0.2…"""

    def __init__(
        self,
        base_dir: str,
        nodes: int,
        *,
        store: str | None = None,
        env: dict | None = None,
        ram: str = "256MiB",
        ram_reserve: str = "0",
        coordinator_args: tuple[str, ...] = (),
    ):
        self.base_dir = base_dir
        self.coordinator = CoordinatorProcess(
            base_dir, store=store, env=env, extra_args=coordinator_args
        )
        self.workers = [
            ClusterWorker(
                os.path.join(base_dir, f"n{i}"),
                f"n{i}",
                f"127.0.0.{i + 1}:{free_port(f'127.0.0.{i + 1}')}",
                self.coordinator,
                env=env,
                ram=ram,
                ram_reserve=ram_reserve,
            )
            for i in range(1, nodes + 1)
        ]

    def start(self) -> Cluster:
        self.coordinator.start()
        for worker in self.workers:
            worker.start()
        expected = len(self.workers)
        wait_for(lambda: sum(n["state"] == "up" for n in self.client.nodes()) == expected, "nodes")
        return self

    @property
    def client(self) -> CoordinatorClient:
        return self.coordinator.client

    def add_dataset(self, name: str, uri: str, **options) -> dict:
        result = self.client.add_dataset(
            {"name": name, "uri": uri, **GENEROUS_STORE_BUDGET, **options}
        )
        for worker in self.workers:
            if worker.proc is not None:
                wait_for(lambda w=worker: os.path.isdir(w.path(name)), f"{name} on {worker.node}")
        return result

    def preload(self, name: str, timeout: float = WAIT_S, **selection) -> dict:
        self.client.preload(name, **selection)
        return self.wait_preload(name, timeout)

    def wait_preload(self, name: str, timeout: float = WAIT_S) -> dict:
        job = {}

        def over() -> bool:
            nonlocal job
            job = self.client.preload_status(name)
            return job["state"] not in ("running", "scheduled")

        wait_for(over, f"preload of {name}", timeout)
        return job

    def worker(self, node: str) -> ClusterWorker:
        return next(w for w in self.workers if w.node == node)

    def cleanup(self) -> None:
        for worker in self.workers:
            worker.cleanup()
        self.coordinator.cleanup()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def read_all(mount: str, files: dict[str, bytes], name: str = "ds") -> list[str]:
    """Read every file through a mount; returns the problems found (never raises)."""
    problems = []
    keys = list(files)
    random.shuffle(keys)
    for key in keys:
        try:
            with open(os.path.join(mount, name, key), "rb") as f:
                data = f.read()
        except OSError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if data != files[key]:
            problems.append(f"{key}: wrong bytes ({len(data)} vs {len(files[key])})")
    return problems


def total_bytes(files: dict[str, bytes], prefix: str = "") -> int:
    return sum(len(d) for k, d in files.items() if k.startswith(prefix))


def locality_settled(cluster: Cluster, name: str, expected: int) -> dict:
    """The locality report once heartbeats have carried ``expected`` cached bytes."""
    report = {}

    def settled() -> bool:
        nonlocal report
        report = cluster.client.locality(name)
        return report["cached_bytes"] == expected

    wait_for(settled, f"{expected} cached bytes of {name} in the locality API")
    return report
