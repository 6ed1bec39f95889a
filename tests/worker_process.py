"""Real `cachefs up` worker processes for integration tests.

Each WorkerProcess is a separate OS process with its own state dir, RAM-tier dir and FUSE mount,
driven through the real control socket. Helpers here never fake the worker: they start it with
the same CLI a user runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

from cachefs.client import ControlClient
from tests.waiting import WAIT_S

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_page_cache() -> None:
    """Make the next reads reach the FUSE process (needs root, as the tests run)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def log_tail(path: str) -> str:
    """The end of a child process's log, for failure messages ("" if there is none yet)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-5000:]
    except FileNotFoundError:
        return ""


def force_unmount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True, check=False)


class WorkerProcess:
    def __init__(
        self,
        base_dir: str,
        *,
        ram: str = "256MiB",
        ram_reserve: str = "0",
        ssd: str | None = None,
        admission: str = "avoid-eviction",
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        command: tuple[str, ...] = ("up",),
        own_process_group: bool = False,
        ram_dir: str | None = None,
    ):
        self.base_dir = base_dir
        self.command = command
        # Its own process group (and session), as a terminal's foreground job: Ctrl-C
        # (os.killpg(proc.pid, SIGINT)) then reaches the worker and every process it started.
        self.own_process_group = own_process_group
        self.state = os.path.join(base_dir, "state")
        self.mount = os.path.join(base_dir, "mnt")
        self.ram_dir = ram_dir or f"/dev/shm/cachefs-test-{uuid.uuid4().hex[:10]}"
        self.args = [
            "--ram",
            ram,
            "--ram-dir",
            self.ram_dir,
            "--ram-reserve",
            ram_reserve,
            "--admission",
            admission,
            "--metrics",
            "off",
            *extra_args,
        ]
        if ssd:
            self.args += ["--ssd", ssd]
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = REPO_ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        self.proc: subprocess.Popen | None = None
        self.client = ControlClient(self.state, timeout=120)
        self.log_path = os.path.join(base_dir, "worker.log")

    def start(self, timeout: float = WAIT_S) -> WorkerProcess:
        """Start the worker and return once it says it serves: the ``cachefs: … serving …``
        line comes after everything the start does (the mount's readahead, the background
        tasks), where the control socket and the mount appear earlier."""
        os.makedirs(self.base_dir, exist_ok=True)
        log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachefs",
                "--state",
                self.state,
                *self.command,
                "--mount",
                self.mount,
                *self.args,
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=self.own_process_group,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            if self._said_serving(log_start) and os.path.ismount(self.mount):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"worker did not come up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return log_tail(self.log_path)

    def _said_serving(self, since: int) -> bool:
        """Whether this start's part of the log (from byte ``since``) has the serving line."""
        with open(self.log_path, "rb") as log:
            log.seek(since)
            return any(
                line.startswith(b"cachefs: ") and b" serving " in line
                for line in log.read().splitlines()
            )

    def stop(self, timeout: float = 30.0) -> None:
        """`cachefs down` equivalent: clean unmount, state kept."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.client.shutdown()
                self.proc.wait(timeout=timeout)
            except Exception:
                self.kill9()
        self.proc = None
        force_unmount(self.mount)  # no-op after a clean stop; clears a stale mount otherwise

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        force_unmount(self.mount)

    def crash(self) -> None:
        """SIGKILL, as the OOM killer does it: the mount is left behind, dead (its readers get
        ENOTCONN), for the next start to clear."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> WorkerProcess:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        self.client.close()
        shutil.rmtree(self.ram_dir, ignore_errors=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.mount, *parts)

    def add_dataset(self, name: str, uri: str, **options) -> dict:
        return self.client.add_dataset(
            {"name": name, "uri": uri, **GENEROUS_STORE_BUDGET, **options}
        )

    def status(self) -> dict:
        return self.client.status()

    def dataset_status(self, name: str) -> dict:
        return next(d for d in self.status()["datasets"] if d["name"] == name)


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
