"""Real `cachefs up` worker processes for integration tests.

Each WorkerProcess is a separate OS process with its own state dir, RAM-tier dir and FUSE mount,
driven through the real control socket. Helpers here never fake the worker: they start it with
the same CLI a user runs (the mechanism is harness/processes.py, shared with the benchmarks;
this module gives it the tests' defaults).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from types import SimpleNamespace

from harness import processes
from harness.processes import REPO_ROOT, drop_page_cache, force_unmount, log_tail
from tests.waiting import WAIT_S

__all__ = [
    "GENEROUS_STORE_BUDGET",
    "REPO_ROOT",
    "WorkerProcess",
    "drop_page_cache",
    "force_unmount",
    "live_process_group",
    "log_tail",
    "start_s3_world",
]


class WorkerProcess(processes.WorkerProcess):
    """A worker with the tests' defaults: no RAM reserve, the avoid-eviction admission, starts
    bounded by WAIT_S, datasets added with :data:`GENEROUS_STORE_BUDGET`."""

    def __init__(
        self,
        base_dir: str,
        *,
        ram: str = "256MiB",
        ram_reserve: str = "0",
        ssd: str | None = None,
        admission: str = "avoid-eviction",
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        command: Sequence[str] = ("up",),
        own_process_group: bool = False,
        ram_dir: str | None = None,
    ):
        super().__init__(
            base_dir,
            command=command,
            ram=ram,
            ram_dir=ram_dir or f"/dev/shm/cachefs-test-{uuid.uuid4().hex[:10]}",
            ram_reserve=ram_reserve,
            ssd=ssd,
            admission=admission,
            extra_args=extra_args,
            env=env,
            own_process_group=own_process_group,
        )

    def start(self, timeout: float = WAIT_S) -> WorkerProcess:
        super().start(timeout)
        return self

    def add_dataset(self, name: str, uri: str, **options) -> dict:
        return self.client.add_dataset(
            {"name": name, "uri": uri, **GENEROUS_STORE_BUDGET, **options}
        )


#: The store budget of the tests' datasets unless a test needs a quick failure (then it
#: passes its own ``timeout_s``/``first_byte_timeout_s``). A request's ``timeout_s`` covers
#: all its tries, and a try silent for half its first-byte timeout gets a hedge (a second
#: GET): on a loaded machine, small numbers would turn tests that read successfully, or count
#: the store's GETs exactly, into flaky ones. Here a hedge comes after 30 s of silence.
GENEROUS_STORE_BUDGET = {"timeout_s": 120.0, "first_byte_timeout_s": 60.0}


def start_s3_world(
    moto_s3,
    fault_proxy,
    directory: str,
    objects: dict[str, bytes],
    *,
    name: str = "ds",
    block_size: int,
    **store_budget: float,
) -> SimpleNamespace:
    """A worker in ``directory`` serving ``objects`` as dataset ``name``, from a new moto
    bucket reached through the fault proxy (which counts and breaks the store's requests).
    ``store_budget`` (``timeout_s``, ``first_byte_timeout_s``) overrides
    :data:`GENEROUS_STORE_BUDGET`. The caller cleans up ``world.worker``."""
    bucket = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    for key, data in objects.items():
        moto_s3.put(bucket, f"{name}/{key}", data)
    worker = WorkerProcess(directory, env=moto_s3.env).start()
    try:
        worker.add_dataset(
            name,
            f"s3://{bucket}/{name}",
            endpoint=fault_proxy.url,
            block_size=block_size,
            **store_budget,
        )
    except BaseException:
        worker.cleanup()
        raise
    return SimpleNamespace(
        worker=worker, objects=objects, proxy=fault_proxy, bucket=bucket, name=name, moto=moto_s3
    )


def live_process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a worker started with
    ``own_process_group``, its fetchers, a shell and what it started). Zombies do not count:
    in a container they may wait long for a reaper."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp …"; comm may hold spaces and parentheses
                state, _ppid, pgrp = f.read().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry))
    return members
