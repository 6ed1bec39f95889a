"""One mount served by several processes (``--fuse-processes N``, cachefs/fs/serving.py): the
worker and N-1 serving processes read clones of the mount's /dev/fuse descriptor. Real worker
processes, real mounts, real serving processes; every byte compared with the source.

N = 1 runs the same tests on the worker alone (the reference the others must equal)."""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time

import pytest

from cachefs.fs.fuse_ops import CLONES_SUPPORTED
from tests.e2e.fs.test_native_reads import (
    BLOCK,
    cli_status_text,
    make_source,
    own_tmpfs,  # noqa: F401 (a fixture)
    read_whole,
    sixteen_readers_through_churn,
)
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import WorkerProcess, drop_page_cache

pytestmark = pytest.mark.skipif(
    not CLONES_SUPPORTED, reason="stock pyfuse3: run scripts/setup.sh to build the patched one"
)

#: What a reader may see from a request that was in flight in a serving process killed with
#: SIGKILL: the kernel ends the requests that process had read with ECONNABORTED; a read the
#: kernel made for readahead and failed shows as EIO.
IN_FLIGHT_ERRORS = (errno.ECONNABORTED, errno.EIO)


def serving(worker: WorkerProcess) -> dict:
    return worker.status()["fuse_processes"] or {}


def serving_pids(worker: WorkerProcess) -> list[int]:
    return sorted(serving(worker).get("pids", []))


def start_worker(tmp_path, processes: int, **options) -> WorkerProcess:
    worker = WorkerProcess(
        str(tmp_path / "w"), extra_args=("--fuse-processes", str(processes)), **options
    ).start()
    if processes > 1:
        wait_for(lambda: len(serving_pids(worker)) == processes - 1, "the serving processes")
    return worker


def process_alive(pid: int) -> bool:
    """True while ``pid`` is a live process (not a zombie) of /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def serving_processes_in_proc() -> list[int]:
    """Every serving process on the machine, from /proc cmdlines."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"cachefs.fs.serving_process" in f.read():
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_sixteen_readers_through_eviction_refresh_and_removal_get_only_right_bytes(
    tmp_path,
    processes,
    own_tmpfs,  # noqa: F811 (the fixture)
):
    """tests/e2e/fs/test_native_reads.py's churn (evictions all the time under 16 readers,
    a file refreshed twice, a dataset removed) served by ``processes`` processes: every byte a
    reader gets is the source's; the tier never holds more than its capacity (every process
    closes a block file before its space is released); the serving processes answer READs in
    C."""
    worker, outcome, capacity = sixteen_readers_through_churn(
        tmp_path, lambda **options: start_worker(tmp_path, processes, **options), own_tmpfs
    )
    try:
        outcome.check(worker, capacity, [worker.status()["pid"], *serving_pids(worker)])
        stats = worker.status()["fuse_fast_read"]
        assert stats["reads"] > 0 and stats["corrupt"] == 0
        if processes > 1:
            assert stats["serving_processes"] == processes
            assert stats["serving_reads"] > 0  # the clones answered READs themselves, in C
            # The readers have stopped: the figures hold still between status and metrics.
            metrics, figures = worker.client.metrics(), serving(worker)
            assert "cachefs_fuse_fast_reads_by_serving_processes_total" in metrics
            assert f"cachefs_fuse_processes {float(processes)}" in metrics
            peer_connections = float(figures["peer_connections"])  # one worker: no peers
            assert f"cachefs_fuse_serving_peer_connections {peer_connections}" in metrics
            for op, count in figures["forwarded"].items():
                line = f'cachefs_fuse_forwarded_requests_total{{op="{op}"}} {float(count)}'
                assert line in metrics
            assert serving(worker)["deaths"] == 0
    finally:
        worker.cleanup()


def test_a_killed_serving_process_is_replaced_and_only_its_requests_fail(tmp_path):
    """kill -9 of serving processes while 16 readers read: each is replaced (a new pid serves),
    the mount stays, every byte read is right, and a read fails only with the errors of a
    request in flight in the killed process, never more of them than requests it could hold."""
    rng = random.Random(99)
    files = {f"d/{i}.bin": rng.randbytes(rng.randint(1_000, 300_000)) for i in range(80)}
    make_source(tmp_path / "src", files)
    worker = start_worker(tmp_path, 3)
    worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
    names = sorted(files)
    wrong: list[str] = []
    failures: list[int] = []
    other_errors: list[str] = []
    stop = threading.Event()
    reads_done = [0]

    def reader(seed: int) -> None:
        pick = random.Random(seed)
        while not stop.is_set():
            name = pick.choice(names)
            try:
                got = read_whole(worker.path("ds", name))
            except OSError as exc:
                if exc.errno in IN_FLIGHT_ERRORS:
                    failures.append(exc.errno)
                else:
                    other_errors.append(f"{name}: {exc}")
                continue
            if got != files[name]:
                wrong.append(name)
            reads_done[0] += 1

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(16)]
    kills = 3
    try:
        for thread in threads:
            thread.start()
        for _ in range(kills):
            target = reads_done[0] + 100
            wait_for(lambda t=target: reads_done[0] >= t, "100 more reads")
            drop_page_cache()
            before = serving_pids(worker)
            victim = before[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda v=victim: not process_alive(v), "the killed process gone")
            wait_for(
                lambda v=victim: len(serving_pids(worker)) == 2 and v not in serving_pids(worker),
                "its replacement serving",
            )
        target = reads_done[0] + 100
        wait_for(lambda: reads_done[0] >= target, "100 reads after the last kill")
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    try:
        assert not wrong, wrong[:5]
        assert not other_errors, other_errors[:5]
        # At most the requests the killed processes had read: 16 readers, each waiting on one
        # READ or LOOKUP at a time, plus the kernel's readahead of their files.
        assert len(failures) <= kills * 32, failures
        assert os.path.ismount(worker.mount)
        figures = serving(worker)
        assert figures["deaths"] == kills and figures["started"] == 2 + kills
        metrics = worker.client.metrics()
        assert "cachefs_fuse_processes 3.0" in metrics
        assert f"cachefs_fuse_serving_process_deaths_total {float(kills)}" in metrics
        for name in names:  # and afterwards every file, whole
            assert read_whole(worker.path("ds", name)) == files[name]
    finally:
        worker.cleanup()


def test_serving_processes_outlive_the_worker_threads_that_started_them(tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that forked a child ends: serving processes
    started from a trio worker thread all died when trio retired that idle thread. They are
    started from the loop's thread; past trio's idle-thread timeout they still serve."""
    from trio._core._thread_cache import IDLE_TIMEOUT

    make_source(tmp_path / "src", {"a.bin": b"a" * 5000})
    worker = start_worker(tmp_path, 3)
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        pids = serving_pids(worker)
        time.sleep(IDLE_TIMEOUT + 5)  # what is waited for is the thread cache's own timeout
        assert read_whole(worker.path("ds", "a.bin")) == b"a" * 5000
        assert serving_pids(worker) == pids and all(process_alive(p) for p in pids)
        assert serving(worker)["deaths"] == 0
    finally:
        worker.cleanup()


@pytest.mark.parametrize("how", ["down", "worker killed"])
def test_no_serving_process_outlives_the_worker(tmp_path, how):
    make_source(tmp_path / "src", {"a.bin": b"a" * 5000})
    worker = start_worker(tmp_path, 4)
    worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
    assert read_whole(worker.path("ds", "a.bin")) == b"a" * 5000
    pids = serving_pids(worker)
    assert len(pids) == 3 and set(pids) <= set(serving_processes_in_proc())
    try:
        if how == "down":
            worker.stop()  # SIGTERM, as `cachefs down` sends: the worker stops them first
        else:
            worker.crash()  # SIGKILL of the worker alone: they die with it (PR_SET_PDEATHSIG)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and any(process_alive(p) for p in pids):
            time.sleep(0.05)
        assert not [pid for pid in pids if process_alive(pid)]
    finally:
        worker.cleanup()


#: Names that are legal on the mount and easy to get wrong on the way through a channel.
ODD_NAMES = [
    "with space.bin",
    "new\nline.bin",
    "tab\t.bin",
    "-leading-dash.bin",
    "back\\slash.bin",
    "per%cent%2F.bin",
    "ünïcødé-名前.bin",
    "quote'\".bin",
    "n" * 251 + ".bin",  # 255 bytes, the longest name
]


def test_odd_names_are_listed_and_served_unchanged_by_every_process(tmp_path):
    files = {f"odd/{name}": f"bytes of {name!r}".encode() * 50 for name in ODD_NAMES}
    make_source(tmp_path / "src", files)
    worker = start_worker(tmp_path, 2)
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for _ in range(4):  # the dentries dropped each time: LOOKUPs reach either process
            drop_page_cache()
            assert sorted(os.listdir(worker.path("ds", "odd"))) == sorted(ODD_NAMES)
            for name, data in files.items():
                assert read_whole(worker.path("ds", name)) == data
        with pytest.raises(FileNotFoundError):
            os.stat(worker.path("ds", "odd/../odd/absent.bin"))
        figures = serving(worker)
        assert figures["deaths"] == 0
        text = cli_status_text(worker)  # `cachefs status` names the processes
        assert f"fuse processes: 2 (serving processes {figures['pids'][0]}; 0 died" in text
    finally:
        worker.cleanup()


def test_more_processes_need_the_native_path_without_passthrough(tmp_path):
    worker = WorkerProcess(
        str(tmp_path / "w"), extra_args=("--fuse-processes", "2", "--fuse-passthrough", "on")
    )
    with pytest.raises(Exception, match="--fuse-passthrough on needs --fuse-processes 1"):
        worker.start()
    worker.cleanup()
    for count in ("0", "65"):
        worker = WorkerProcess(str(tmp_path / f"w{count}"), extra_args=("--fuse-processes", count))
        with pytest.raises(Exception, match="--fuse-processes"):
            worker.start()
        worker.cleanup()
