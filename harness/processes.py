"""Child processes for tests and benchmarks: a cachefs worker, a coordinator, any other command.

Each runs this checkout's code (:func:`child_env` puts its root first on ``PYTHONPATH``), writes
its output to a log file whose tail goes into every error about it (:class:`ProcessFailure`),
and is stopped without leaving a process, a mount or a RAM-tier directory behind. A child in its
own session (``own_session``) has its own process group: a Ctrl-C at the terminal reaches the
caller first, which then stops it, and killing the group reaches the processes it started (a
worker's fetcher processes).

Nothing here picks a size, a timeout policy or a heartbeat for its callers: the worker's and the
coordinator's options come from them (tests/worker_process.py, bench/read_bench.py, ...).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence

from cachefs.client import ControlClient, CoordinatorClient

#: The checkout's root: children import cachefs (and bench) from here.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How much of a child's log an error message carries.
LOG_TAIL_CHARS = 5000


class ProcessFailure(RuntimeError):
    """A child exited, or did not come up in time; the message ends with the tail of its log."""


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` over it and the checkout's root first on
    ``PYTHONPATH``: the child runs this checkout's code whatever its working directory."""
    merged = {**os.environ, **(env or {})}
    merged["PYTHONPATH"] = REPO_ROOT + os.pathsep + merged.get("PYTHONPATH", "")
    return merged


def log_tail(path: str, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a child's log, for error messages ("" before the log exists)."""
    try:
        with open(path, errors="replace") as log:
            return log.read()[-chars:]
    except FileNotFoundError:
        return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def force_unmount(path: str) -> None:
    """Lazy unmount (``umount -l``): clears a mount its dead worker left behind; nothing when
    ``path`` is not a mount."""
    subprocess.run(["umount", "-l", path], capture_output=True, check=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (all its threads), from
    /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()  # the name may hold ") "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (a worker's serving processes, its fetcher
    processes), from /proc."""
    children = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if parent == pid:
            children.append(int(entry.name))
    return children


def family_cpu_seconds(pid: int) -> float:
    """CPU time ``pid`` and its live children have used so far (a worker and its serving
    processes: the work of one mount, all processes summed)."""
    total = cpu_seconds(pid)
    for child in child_pids(pid):
        try:
            total += cpu_seconds(child)
        except OSError:
            pass  # exited meanwhile
    return total


def drop_page_cache() -> None:
    """Drop clean pages, dentries and inodes, so the next reads reach the filesystem (root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("3\n")


def spawn(
    argv: Sequence[str], log_path: str, env: dict[str, str], *, own_session: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with its stdout and stderr appended to ``log_path`` and no stdin."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=own_session,
        )


def kill(process: subprocess.Popen[bytes], *, own_session: bool = False) -> None:
    """SIGKILL, to its whole process group when it has its own session (whatever of the group
    outlived it goes too), then reap it."""
    if own_session:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    elif process.poll() is None:
        process.send_signal(signal.SIGKILL)
    if process.poll() is None:
        process.wait(timeout=10)


def terminate(
    process: subprocess.Popen[bytes], *, timeout: float = 15.0, own_session: bool = False
) -> None:
    """SIGTERM, then :func:`kill` once ``timeout`` has passed (or at once, for the leftovers of
    its group, when it has its own session)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    if own_session or process.poll() is None:
        kill(process, own_session=own_session)


def wait_until(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    log_path: str,
) -> None:
    """Poll ``ready()`` until it holds while ``process`` runs. :class:`ProcessFailure` when the
    process exits first or ``timeout`` passes. A ``ready`` that raises counts as "not yet" (a
    server that does not answer yet)."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ProcessFailure(f"{what} exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            if ready():
                return
        except Exception as exc:  # not answering yet; said below if it never does
            last_error = f" (last error: {type(exc).__name__}: {exc})"
        time.sleep(0.05)
    raise ProcessFailure(f"{what} did not come up in {timeout}s{last_error}:\n{log_tail(log_path)}")


class ChildProcess:
    """Any command, started at construction, in its own session unless told otherwise."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: str,
        env: dict[str, str],
        *,
        own_session: bool = True,
    ):
        self.log_path = log_path
        self.own_session = own_session
        self.process = spawn(argv, log_path, env, own_session=own_session)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return log_tail(self.log_path, chars)

    def terminate(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL (of its process group, with the processes it started)."""
        terminate(self.process, timeout=timeout, own_session=self.own_session)

    def kill_group(self) -> None:
        kill(self.process, own_session=self.own_session)


class WorkerProcess:
    """``python -m cachefs --state STATE [--log-level L] COMMAND --mount MOUNT --ram ...``: a
    worker (``up``, or ``worker --coordinator ...`` in ``command``) with its own state dir,
    RAM-tier dir, mount and log, driven through its real control socket.

    By default the state dir, mount and log are ``base_dir``'s ``state``, ``mnt`` and
    ``worker.log``. Options left at None are not passed (the CLI's defaults apply).
    :meth:`start` returns once the worker says it serves; :meth:`launch` and
    :meth:`wait_serving` split it, to start several workers at once."""

    def __init__(
        self,
        base_dir: str,
        *,
        command: Sequence[str] = ("up",),
        ram: str = "256MiB",
        ram_dir: str | None = None,
        ram_reserve: str | None = None,
        ssd: str | None = None,
        admission: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_level: str | None = None,
        own_process_group: bool = False,
        state: str | None = None,
        mount: str | None = None,
        log_path: str | None = None,
        client_timeout: float = 120.0,
    ):
        self.base_dir = base_dir
        self.command = tuple(command)
        # Its own process group (and session), as a terminal's foreground job: Ctrl-C
        # (os.killpg(proc.pid, SIGINT)) then reaches the worker and every process it started.
        self.own_process_group = own_process_group
        self.state = state or os.path.join(base_dir, "state")
        self.mount = mount or os.path.join(base_dir, "mnt")
        self.log_path = log_path or os.path.join(base_dir, "worker.log")
        self.ram_dir = ram_dir or f"/dev/shm/cachefs-worker-{uuid.uuid4().hex[:10]}"
        self.global_args = ["--log-level", log_level] if log_level else []
        self.args = ["--ram", ram, "--ram-dir", self.ram_dir]
        for option, value in (
            ("--ram-reserve", ram_reserve),
            ("--admission", admission),
            ("--ssd", ssd),
        ):
            if value is not None:
                self.args += [option, value]
        self.args += ["--metrics", "off", *extra_args]
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = ControlClient(self.state, timeout=client_timeout)
        self._log_start = 0

    @property
    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "cachefs", "--state", self.state, *self.global_args,
            *self.command, "--mount", self.mount, *self.args,
        ]  # fmt: skip

    def start(self, timeout: float = 120.0) -> WorkerProcess:
        """Start the worker and return once it says it serves."""
        self.launch()
        self.wait_serving(timeout)
        return self

    def launch(self) -> None:
        os.makedirs(self.base_dir, exist_ok=True)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self.proc = spawn(self.argv, self.log_path, self.env, own_session=self.own_process_group)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until its ``cachefs: … serving …`` line: it comes after everything the start does
        (the mount's readahead, the background tasks), where the control socket and the mount
        appear earlier."""
        assert self.proc is not None, "launch() first"
        wait_until(
            self.proc,
            lambda: self._said_serving() and os.path.ismount(self.mount),
            f"the worker on {self.mount}",
            timeout,
            self.log_path,
        )

    def _said_serving(self) -> bool:
        """Whether this start's part of the log has the serving line."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return any(
                line.startswith(b"cachefs: ") and b" serving " in line
                for line in log.read().splitlines()
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return log_tail(self.log_path)

    def stop(self, timeout: float = 30.0) -> None:
        """``cachefs down`` equivalent: clean unmount, state kept. A worker that does not exit
        within ``timeout`` gets SIGTERM, then SIGKILL."""
        if self.alive():
            assert self.proc is not None
            try:
                self.client.shutdown()
            except Exception:  # no answer, or the connection closed while answering: wait
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                terminate(self.proc, timeout=10, own_session=self.own_process_group)
        if self.proc is not None and self.own_process_group:
            kill(self.proc, own_session=True)  # what of its group outlived it
        self.proc = None
        force_unmount(self.mount)  # no-op after a clean stop; clears a stale mount otherwise

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            kill(self.proc, own_session=self.own_process_group)
        self.proc = None
        force_unmount(self.mount)

    def crash(self) -> None:
        """SIGKILL of the worker alone, as the OOM killer does it: the mount is left behind,
        dead (its readers get ENOTCONN), for the next start to clear."""
        if self.alive():
            assert self.proc is not None
            kill(self.proc)
        self.proc = None

    def restart(self) -> WorkerProcess:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop it and remove its RAM-tier directory (its state dir stays)."""
        self.stop()
        self.client.close()
        shutil.rmtree(self.ram_dir, ignore_errors=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.mount, *parts)

    def status(self) -> dict:
        return self.client.status()

    def dataset_status(self, name: str) -> dict:
        return next(d for d in self.status()["datasets"] if d["name"] == name)


class CoordinatorProcess:
    """``python -m cachefs [--log-level L] coordinator --state STATE --listen 127.0.0.1:PORT
    [--store STORE] EXTRA_ARGS`` with ``token`` as its API token (``CACHEFS_TOKEN``), its
    state in ``base_dir``'s ``coordinator`` and its log in ``coordinator.log`` unless told."""

    def __init__(
        self,
        base_dir: str,
        *,
        token: str,
        store: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_level: str | None = None,
        own_process_group: bool = False,
        state: str | None = None,
        log_path: str | None = None,
    ):
        self.base_dir = base_dir
        self.state = state or os.path.join(base_dir, "coordinator")
        self.log_path = log_path or os.path.join(base_dir, "coordinator.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store
        self.extra_args = tuple(extra_args)
        self.global_args = ["--log-level", log_level] if log_level else []
        self.own_process_group = own_process_group
        self.env = child_env({**(env or {}), "CACHEFS_TOKEN": token})
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = CoordinatorClient(self.url, token, timeout=30)

    @property
    def argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "cachefs", *self.global_args, "coordinator",
            "--state", self.state, "--listen", f"127.0.0.1:{self.port}",
        ]  # fmt: skip
        if self.store:
            argv += ["--store", self.store]
        return argv + list(self.extra_args)

    def start(self, timeout: float = 60.0) -> CoordinatorProcess:
        """Start it and return once ``/healthz`` answers."""
        os.makedirs(self.base_dir, exist_ok=True)
        self.proc = spawn(self.argv, self.log_path, self.env, own_session=self.own_process_group)
        wait_until(
            self.proc,
            lambda: self.client.health() is not None,
            f"the coordinator on {self.url}",
            timeout,
            self.log_path,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return log_tail(self.log_path)

    def kill9(self) -> None:
        if self.proc is not None:
            kill(self.proc, own_session=self.own_process_group)
        self.proc = None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (it saves and exits), SIGKILL after ``timeout``."""
        if self.proc is not None:
            terminate(self.proc, timeout=timeout, own_session=self.own_process_group)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        self.client.close()
