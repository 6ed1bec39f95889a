"""`cachefs stats` against real workers and a real coordinator, and the progress bar of
`cachefs preload --wait`: driven under a pseudo-terminal, what the screen shows read through a
terminal emulator (pyte), as a user would see it; and through pipes, as scripts read it.

Every number shown is checked against the worker's own counters, read from fields the view
does not use (`cachefs status`'s reads, store and peer sections, the /metrics text) or known to
the test (the files it read). Rates are only checked to be there and non-negative, and to
become positive while files are being read: never their size (no timing assertion).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pyte
import pytest

from cachefs.units import format_size
from tests.cluster_process import Cluster
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import REPO_ROOT, WorkerProcess, drop_page_cache

FILES = 12
FILE_SIZE = 1_500_000  # 6 blocks of 256 KiB, and more than one FUSE READ (at most 1 MiB)
BLOCK_SIZE = 256 << 10
ROWS, COLUMNS = 60, 230


# --- a program on a pseudo-terminal --------------------------------------------------------


class Terminal:
    """A command run on a pseudo-terminal that is its controlling terminal (so that Ctrl-C
    typed there interrupts it as in a shell), its output fed to a VT100 emulator."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**env, "TERM": "xterm-256color"},
            start_new_session=True,
            preexec_fn=_controlling_terminal_and_default_ctrl_c,
        )
        os.close(slave)
        self._master = master
        self._screen = pyte.Screen(COLUMNS, ROWS)
        self._stream = pyte.ByteStream(self._screen)
        self._lock = threading.Lock()
        self._raw = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the program exited and the terminal closed
                return
            if not data:
                return
            with self._lock:
                self._raw += data
                self._stream.feed(data)

    def screen(self) -> list[str]:
        """The lines the terminal shows now, right-stripped."""
        with self._lock:
            return [line.rstrip() for line in self._screen.display]

    def written(self) -> str:
        """Everything written so far, escape sequences removed: every frame drawn."""
        with self._lock:
            text = self._raw.decode(errors="replace")
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text)

    def wait_for_screen(self, predicate, what: str) -> list[str]:
        shown: list[str] = []

        def holds() -> bool:
            nonlocal shown
            shown = self.screen()
            return bool(predicate(shown))

        try:
            wait_for(holds, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n" + "\n".join(shown)) from None
        return shown

    def ctrl_c(self) -> int:
        os.write(self._master, b"\x03")
        return self.wait()

    def wait(self) -> int:
        code = self.proc.wait(timeout=WAIT_S)
        self._reader.join(timeout=WAIT_S)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)
        self._reader.join(timeout=WAIT_S)
        os.close(self._master)


def _controlling_terminal_and_default_ctrl_c() -> None:
    """In the child: the pty becomes its controlling terminal, and Ctrl-C its default action.
    A test run started in the background (`… &` in a script, as CI may) ignores SIGINT, and
    children inherit that: Python would then never raise KeyboardInterrupt."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cachefs_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "cachefs", *args]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, without what would point the CLI elsewhere or size its output."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("CACHEFS_COORDINATOR", "COLUMNS", "LINES"):
        if name not in (extra or {}):
            env.pop(name, None)
    return env


def cells(line: str) -> list[str]:
    """The cells of a table row drawn by rich: ``│ a │ b │`` → ["a", "b"]."""
    return [cell.strip() for cell in line.strip().strip("│").split("│")]


def table_rows(screen: list[str], title: str) -> tuple[list[str], dict[str, list[str]]]:
    """The header and the rows (by their first cell) of the table under ``title``."""
    start = next(i for i, line in enumerate(screen) if line.strip().startswith(title))
    header, rows = [], {}
    for line in screen[start + 1 :]:
        if line.startswith("┃"):
            header = cells(line.replace("┃", "│"))
        elif line.startswith("│"):
            row = cells(line)
            rows[row[0]] = row
        elif line.startswith("└"):
            break
    return header, rows


# --- the worker's own numbers, from fields the view does not read ---------------------------


def expected_totals(worker: WorkerProcess, files_read: int) -> dict[str, str]:
    """What the "since the worker started" table must show, by column: from the status'
    reads/store/peers sections and /metrics, and the files the test read."""
    status = worker.status()
    reads = status["reads"]
    metrics = worker.client.metrics()
    python_reads = re.search(r'^cachefs_fuse_op_seconds_count\{op="read"\} (\S+)$', metrics, re.M)
    files = re.search(r"^cachefs_fuse_files_read_total (\S+)$", metrics, re.M)
    assert float(files.group(1)) == files_read  # the READs at offset 0, one per file read
    native = status["fuse_fast_read"]  # the native READ path's counters, when it serves
    return {
        **({"NATIVE READS": str(native["reads"])} if native is not None else {}),
        "FILES": str(files_read),
        "BYTES": format_size(sum(reads["bytes_served"].values())),
        "RAM HITS": str(reads["hits"]["ram"]),
        "SSD HITS": str(reads["hits"]["ssd"]),
        "RECENT HITS": str(reads["hits"]["recent"]),
        "MISSES": str(reads["misses"]),
        "PYTHON READS": str(int(float(python_reads.group(1)))),
        "PEER GETS": str(sum(status["peers"]["requests"].values())),
        "STORE GETS": str(
            sum(n for op, n in status["store"]["requests"].items() if op.startswith("get:"))
        ),
    }


def json_totals(row: dict) -> dict[str, str]:
    """A node's totals in `stats --json`, in the table's words (to compare with the above)."""
    totals = row["totals"]
    return {
        "FILES": str(totals["files_read"]),
        "BYTES": format_size(totals["bytes_read"]),
        "RAM HITS": str(totals["hits"]["ram"]),
        "SSD HITS": str(totals["hits"]["ssd"]),
        "RECENT HITS": str(totals["hits"]["recent"]),
        "MISSES": str(totals["misses"]),
        "PYTHON READS": str(totals["python_reads"]),
        **({"NATIVE READS": str(totals["native_reads"])} if "native_reads" in totals else {}),
        "PEER GETS": str(totals["peer_gets"]),
        "STORE GETS": str(totals["store_gets"]),
    }


def check_rates(row: dict) -> None:
    """Every rate is there and non-negative; the shares of block reads add up to 1 (or are
    all unknown: no block read in the interval)."""
    rates = row["rates"]
    assert {"files_per_s", "bytes_per_s", "python_reads_per_s"} <= set(rates)
    assert {"peer_gets_per_s", "store_gets_per_s"} <= set(rates)
    assert all(value is not None and value >= 0 for value in rates.values()), rates
    shares = list(row["hit_ratio"].values())
    assert all(s is None for s in shares) or abs(sum(shares) - 1) < 1e-9, shares
    for op, latency in row["fuse_latency_s"].items():
        known = [latency[p] for p in ("p50", "p90", "p99") if latency[p] is not None]
        assert known == sorted(known) and all(v > 0 for v in known), (op, latency)


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def source(tmp_path) -> dict[str, bytes]:
    directory = tmp_path / "source"
    directory.mkdir()
    files = {f"f{i:02d}.bin": os.urandom(FILE_SIZE) for i in range(FILES)}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


@pytest.fixture
def worker(tmp_path, source):
    worker = WorkerProcess(str(tmp_path / "worker")).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'source'}", block_size=BLOCK_SIZE)
        yield worker
    finally:
        worker.cleanup()


def read_every_file(mount: str, files: dict[str, bytes], *, forget_pages: bool = False) -> None:
    """Read each file once through the mount, byte-exact. ``forget_pages``: drop the file's
    pages afterwards (the next read reaches the worker again), without touching other
    processes' page cache as drop_page_cache does."""
    for name, data in files.items():
        with open(os.path.join(mount, "ds", name), "rb") as f:
            assert f.read() == data, f"wrong bytes in {name}"
            if forget_pages:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# --- a worker --------------------------------------------------------------------------------


def test_live_view_on_a_terminal_shows_the_workers_counters_and_ctrl_c_quits(worker, source):
    """`cachefs stats` under a pseudo-terminal while files are read through the mount: the
    table of totals comes to show the worker's counters exactly, some frame shows the reads
    as positive rates, and Ctrl-C ends it with status 130 and nothing printed."""
    node = worker.status()["node"]
    term = Terminal(cachefs_argv("--state", worker.state, "stats", "--interval", "0.3s"), cli_env())
    try:
        term.wait_for_screen(
            lambda screen: any(line.startswith("cachefs stats") for line in screen),
            "the first frame",
        )
        drop_page_cache()
        read_every_file(worker.mount, source)

        def totals_shown() -> bool:
            header, rows = table_rows(term.screen(), "since the worker started")
            if node not in rows:
                return False
            return dict(zip(header[1:], rows[node][1:], strict=True)) == expected_totals(
                worker, FILES
            )

        try:
            wait_for(totals_shown, "the worker's counters on the screen")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nexpected {expected_totals(worker, FILES)}; the screen:\n"
                + "\n".join(term.screen())
            ) from None
        screen = term.screen()
        header, rows = table_rows(screen, "last interval: rates")
        assert node in rows
        # A worker whose native READ path serves reports its reads: one more column.
        assert ("NATIVE READS/S" in header) == (worker.status()["fuse_fast_read"] is not None)
        assert [name for name in header if name != "NATIVE READS/S"][:6] == [
            "NODE", "FILES/S", "MB/S", "PYTHON READS/S", "PEER GETS/S", "STORE GETS/S"
        ]  # fmt: skip

        # The node's row of "last interval" in every frame drawn: each rate is a non-negative
        # number or "-" (no interval yet), and the frame whose interval covered the reads
        # showed them.
        frames = [
            row
            for row in map(cells, term.written().splitlines())
            if row[0] == node and len(row) == len(header)
        ]
        assert frames
        rates = [row[1:6] for row in frames]
        assert all(r == "-" or float(r) >= 0 for row in rates for r in row), rates
        assert any(row[0] != "-" and float(row[0]) > 0 for row in rates), rates

        assert term.ctrl_c() == 130
        after = term.written().rsplit("cachefs stats", 1)[-1]
        assert "Traceback" not in after and "cachefs:" not in after, after
    finally:
        term.close()


def test_once_json_matches_the_status_and_lines_follow_the_reads(worker, source):
    """`stats --once --json` is one document whose totals are `cachefs status --json`'s
    counters; without --once, --json prints a line per interval, whose rates turn positive
    while files are read; SIGINT ends it with 130 and nothing on stderr."""
    drop_page_cache()
    read_every_file(worker.mount, source)
    once = subprocess.run(
        cachefs_argv("--state", worker.state, "stats", "--once", "--json", "--interval", "0.2s"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert once.returncode == 0, once.stderr
    view = json.loads(once.stdout)
    assert view["scope"] == "worker" and len(view["nodes"]) == 1
    row = view["nodes"][0]
    assert json_totals(row) == expected_totals(worker, FILES)
    status = subprocess.run(
        cachefs_argv("--state", worker.state, "status", "--json"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    reads = json.loads(status.stdout)["reads"]
    assert row["totals"]["hits"] == reads["hits"] and row["totals"]["misses"] == reads["misses"]
    assert row["interval_s"] > 0
    check_rates(row)
    assert row["rates"]["files_per_s"] == 0  # nothing was read between its two samples
    native_on = worker.status()["fuse_fast_read"] is not None
    assert ("native_reads_per_s" in row["rates"]) == native_on

    lines: list[dict] = []
    live = subprocess.Popen(
        cachefs_argv("--state", worker.state, "stats", "--json", "--interval", "0.3s"),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see above
    )
    stop_reading = threading.Event()

    def keep_reading() -> None:
        while not stop_reading.is_set():
            read_every_file(worker.mount, source, forget_pages=True)

    def collect() -> None:
        for line in live.stdout:
            lines.append(json.loads(line))

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    reader = threading.Thread(target=keep_reading, daemon=True)
    try:
        wait_for(lambda: lines, "the first JSON line")
        reader.start()
        wait_for(
            lambda: any((r["nodes"][0]["rates"]["files_per_s"] or 0) > 0 for r in lines),
            "a line showing the reads",
        )
    finally:
        stop_reading.set()
        if reader.is_alive():
            reader.join(timeout=WAIT_S)
        live.send_signal(signal.SIGINT)
        _, err = live.communicate(timeout=WAIT_S)
        collector.join(timeout=WAIT_S)
    assert live.returncode == 130 and err == "", err
    assert lines[0]["nodes"][0]["interval_s"] is None  # one sample: no rate yet
    for later in lines[1:]:
        check_rates(later["nodes"][0])
    busy = next(r for r in lines if (r["nodes"][0]["rates"]["files_per_s"] or 0) > 0)
    assert busy["nodes"][0]["rates"]["bytes_per_s"] > 0
    # The READs reached the worker: Python's handler, or the native path (cached blocks).
    python_reads = busy["nodes"][0]["fuse_latency_s"].get("read", {}).get("requests", 0)
    assert python_reads + (busy["nodes"][0]["rates"].get("native_reads_per_s") or 0) > 0
    ratios = busy["nodes"][0]["hit_ratio"]
    assert ratios["ram"] + ratios["recent"] + ratios["miss"] > 0


def test_plain_lines_when_not_a_terminal_and_one_line_errors(worker, source, tmp_path):
    """Piped, `cachefs stats --once` prints plain lines (no escape codes); a bad interval and
    a worker that is not running are one line each, exit 1."""
    drop_page_cache()
    read_every_file(worker.mount, source)
    once = subprocess.run(
        cachefs_argv("--state", worker.state, "stats", "--once", "--interval", "0.2s"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert once.returncode == 0, once.stderr
    assert "\x1b" not in once.stdout
    (line,) = once.stdout.splitlines()
    assert f"files {FILES}  " in line and "files/s 0.0" in line and "store GETs/s" in line

    for args, message in [
        (("--state", worker.state, "stats", "--interval", "0"), "--interval must be more than 0"),
        (("--state", str(tmp_path / "none"), "stats", "--once"), "no cachefs worker is running"),
    ]:
        failed = subprocess.run(
            cachefs_argv(*args), env=cli_env(), capture_output=True, text=True, timeout=WAIT_S
        )
        assert failed.returncode == 1 and failed.stderr.count("\n") == 1, failed.stderr
        assert failed.stderr.startswith("cachefs: error: ") and message in failed.stderr


# --- the cluster -----------------------------------------------------------------------------


def test_cluster_view_shows_every_node_and_the_total(tmp_path, source):
    """`cachefs stats --coordinator URL`, against a real coordinator and two workers after
    files were read through one node's mount (the other node serving its shards as a peer):
    per node the worker's own counters as its heartbeats carried them, and their sum."""
    cluster = Cluster(str(tmp_path / "cluster"), 2).start()
    try:
        cluster.add_dataset("ds", f"file://{tmp_path / 'source'}", block_size=BLOCK_SIZE)
        reader = cluster.workers[0]
        drop_page_cache()
        read_every_file(reader.mount, source)

        def heartbeats_carried() -> bool:
            reported = {n["node"]: n["activity"] for n in cluster.client.nodes()}
            return all(
                reported[w.node] is not None
                and reported[w.node]["counters"] == w.status()["activity"]["counters"]
                for w in cluster.workers
            )

        wait_for(heartbeats_carried, "the workers' counters in their heartbeats")
        env = cli_env({"CACHEFS_TOKEN": cluster.coordinator.env["CACHEFS_TOKEN"]})
        coordinator = ("--coordinator", cluster.coordinator.url)
        once = subprocess.run(
            cachefs_argv(*coordinator, "stats", "--once", "--json", "--interval", "0.2s"),
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert once.returncode == 0, once.stderr
        view = json.loads(once.stdout)
        assert view["scope"] == "cluster"
        rows = {row["node"]: row for row in view["nodes"]}
        assert set(rows) == {"n1", "n2"}
        expected = {
            w.node: expected_totals(w, FILES if w is reader else 0) for w in cluster.workers
        }
        for worker in cluster.workers:
            assert json_totals(rows[worker.node]) == expected[worker.node]
            assert rows[worker.node]["state"] == "up"
            check_rates(rows[worker.node])
        assert int(expected["n1"]["PEER GETS"]) > 0  # n1 asked n2 for n2's shards
        total = view["total"]["totals"]
        for field in ("files_read", "bytes_read", "misses", "python_reads", "store_gets"):
            assert total[field] == sum(row["totals"][field] for row in rows.values())
        check_rates(view["total"])

        term = Terminal(cachefs_argv(*coordinator, "stats", "--once", "--interval", "0.2s"), env)
        try:
            assert term.wait() == 0
            screen = term.screen()
        finally:
            term.close()
        header, shown = table_rows(screen, "since the worker started")
        for worker in cluster.workers:
            assert (
                dict(zip(header[1:], shown[worker.node][1:], strict=True)) == expected[worker.node]
            )
        assert shown["TOTAL"][1] == str(FILES)
        assert set(table_rows(screen, "last interval: rates")[1]) == {"n1", "n2", "TOTAL"}
    finally:
        cluster.cleanup()


# --- preload --wait ------------------------------------------------------------------------


def test_preload_progress_bar_on_a_terminal(worker, source):
    """`cachefs preload --wait` on a terminal: rich's bar ends on the finished job's line, with
    nothing left of earlier, longer lines; Ctrl-C on a scheduled one says what goes on."""
    term = Terminal(cachefs_argv("--state", worker.state, "preload", "ds", "--wait"), cli_env())
    try:
        assert term.wait() == 0
        screen = term.screen()
    finally:
        term.close()
    bars = [line for line in screen if "objects" in line and "[#" not in line]
    assert len(bars) == 1, screen
    done = f"{FILES}/{FILES} objects  {format_size(FILES * FILE_SIZE)}/"
    assert "100%" in bars[0] and done in bars[0], bars
    assert bars[0].endswith("failed 0"), bars  # the caption's end: nothing stale after it

    tomorrow = str(time.time() + 86400)
    term = Terminal(
        cachefs_argv("--state", worker.state, "preload", "ds", "--at", tomorrow, "--wait"),
        cli_env(),
    )
    try:
        term.wait_for_screen(
            lambda screen: any("scheduled for" in line for line in screen), "the scheduled job"
        )
        assert term.ctrl_c() == 130
        screen = [line for line in term.screen() if line]
    finally:
        term.close()
    assert screen[-1] == (
        "cachefs: stopped waiting; the preload of 'ds' goes on: `cachefs preload status ds`"
    ), screen
    assert "Traceback" not in term.written()


# --- the arithmetic, on made-up samples --------------------------------------------------------


def sample(sampled_at: float, *, native: int | None = None, **counters: int):
    from cachefs.stats import NodeSample, Sample

    if native is not None:
        counters["native_reads"] = native
    latency = {"read": [1, 2, 6, 1]}  # per second: buckets <=1 ms, <=2 ms, <=4 ms, +Inf
    activity = {
        "sampled_at": sampled_at,
        "counters": counters,
        "fuse_latency_bounds": [1e-3, 2e-3, 4e-3],
        "fuse_latency": {op: [n * int(sampled_at) for n in c] for op, c in latency.items()},
    }
    return Sample("worker", "test", [NodeSample.of("n1", True, activity)], [], [])


def test_rates_shares_and_percentiles_come_from_the_deltas_between_two_samples():
    """Rates are deltas over the samples' own clock; shares and percentiles are over the
    interval's block reads and requests (Prometheus's interpolation within a bucket)."""
    from cachefs.stats import Tracker, view_of

    tracker = Tracker()
    tracker.update(sample(1.0, files_read=10, bytes_read=1000, hits_ram=5, misses=5))
    tracker.update(sample(3.0, files_read=14, bytes_read=5000, hits_ram=11, misses=7))
    row = view_of(sample(3.0), tracker, 2.0)["nodes"][0]
    assert row["interval_s"] == 2.0
    assert row["rates"]["files_per_s"] == 2.0 and row["rates"]["bytes_per_s"] == 2000.0
    assert row["hit_ratio"] == {"ram": 0.75, "ssd": 0.0, "recent": 0.0, "miss": 0.25}
    assert row["totals"]["files_read"] == 14 and row["totals"]["hits"]["ram"] == 11
    read = row["fuse_latency_s"]["read"]  # the interval's 20 requests: 2, 4, 12, 2 (+Inf)
    assert read["requests"] == 20
    assert read["p50"] == pytest.approx(2e-3 + 2e-3 * (10 - 6) / 12)  # the 10th of 20
    assert read["p90"] == pytest.approx(4e-3)  # the 18th: the top of its bucket
    assert read["p99"] == 4e-3  # in the +Inf bucket: its lower bound
    assert "native_reads_per_s" not in row["rates"]


def test_a_restarted_worker_has_no_rate_until_its_next_sample():
    from cachefs.stats import Tracker, view_of

    tracker = Tracker()
    tracker.update(sample(5.0, files_read=100))
    tracker.update(sample(6.0, files_read=3))  # counters went down: a new worker process
    row = view_of(sample(6.0), tracker, 1.0)["nodes"][0]
    assert row["interval_s"] is None and row["rates"]["files_per_s"] is None
    assert row["totals"]["files_read"] == 3


def test_native_reads_are_shown_once_a_worker_reports_them():
    """The native fast path's reads are one more counter in WorkerMetrics.activity():
    reported, they get their rate, their total and their columns, with no other change."""
    from cachefs.stats import Tracker, plain_lines, view_of

    tracker = Tracker()
    tracker.update(sample(1.0, python_reads=4, native=10))
    tracker.update(sample(2.0, python_reads=5, native=30))
    view = view_of(sample(2.0), tracker, 1.0)
    row = view["nodes"][0]
    assert row["rates"]["native_reads_per_s"] == 20.0
    assert row["totals"]["native_reads"] == 30
    (line,) = plain_lines(view)
    assert "native reads/s 20.0" in line and "native reads 30" in line
