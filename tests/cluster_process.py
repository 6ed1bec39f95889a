"""A real cluster for integration tests: a `cachefs coordinator` process and `cachefs worker`
processes, each "node" on its own loopback address (127.0.0.2, .3, …) with its own state dir,
RAM-tier dir and FUSE mount. Started with the same CLI a user runs."""

from __future__ import annotations

import os
import random
import shutil

from cachefs.client import CoordinatorClient
from harness import processes
from harness.processes import free_port
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import GENEROUS_STORE_BUDGET, WorkerProcess

TOKEN = "test-token-0123456789"
HEARTBEAT = "0.3s"
DOWN_AFTER = "1.5s"


class CoordinatorProcess(processes.CoordinatorProcess):
    """A coordinator with the tests' token, quick heartbeats and down-after, starts bounded by
    WAIT_S."""

    def __init__(
        self,
        base_dir: str,
        *,
        store: str | None = None,
        env: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        super().__init__(
            base_dir,
            token=TOKEN,
            store=store,
            env=env,
            extra_args=(
                *("--heartbeat-interval", HEARTBEAT, "--down-after", DOWN_AFTER),
                *extra_args,
            ),
        )

    def start(self, timeout: float = WAIT_S) -> CoordinatorProcess:
        super().start(timeout)
        return self


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
        extra_args: tuple[str, ...] = (),
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
            extra_args=extra_args,
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
        peer_timeout: str = "1s",
        worker_args: tuple[str, ...] = (),
    ):
        """``peer_timeout``: short by default, so that tests of dead peers are quick; a test
        that counts store GETs exactly passes a generous one (a peer answer slower than the
        timeout on a loaded machine is read from the store again, as it should be).
        ``worker_args``: more `cachefs worker` options, for every worker."""
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
                peer_timeout=peer_timeout,
                extra_args=worker_args,
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
