"""The preload fetcher pool (cachefs/cluster/fetchers.py): real forkserver processes fetching
from a real local store, owned by a real separate process that is then killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT

OWNER = textwrap.dedent(
    """
    import json, multiprocessing.forkserver, multiprocessing.resource_tracker, sys, time
    from cachefs.cluster.fetchers import FetcherPool
    from cachefs.store import StoreConfig, open_store

    config = StoreConfig(uri=sys.argv[1])
    etag = open_store(config).head("obj.bin").etag
    pool = FetcherPool(2)
    data = pool.fetch(config, "obj.bin", 3, 5, etag).data
    print(json.dumps({
        "data": data.hex(),
        "fetchers": pool.pids(),
        "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid,
        "resource_tracker": multiprocessing.resource_tracker._resource_tracker._pid,
    }), flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the
        return False  # open and the read (ESRCH): both mean it ended


def test_fetchers_and_their_forkserver_end_when_their_owner_is_killed(tmp_path):
    (tmp_path / "obj.bin").write_bytes(b"0123456789")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, f"file://{tmp_path}"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(owner.stdout.readline())
        assert bytes.fromhex(started["data"]) == b"34567"  # a real fetch in a pool process
        # Fetchers start on demand (one fetch: all of them), with a forkserver and
        # multiprocessing's resource tracker.
        helpers = [*started["fetchers"], started["forkserver"], started["resource_tracker"]]
        assert started["fetchers"] and None not in helpers
        assert all(alive(pid) for pid in helpers)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + WAIT_S  # a bounded wait for them to go, not a timing check
        while any(alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in helpers if alive(pid)]
        for pid in left:  # leave nothing running, whatever the outcome
            os.kill(pid, signal.SIGKILL)
        assert not left, f"still running after their owner was killed: {left}"
    finally:
        owner.kill()
        owner.wait()


#: Object names that must cross the pipe to a fetcher unchanged: non-ASCII, control characters,
#: and a byte that is not UTF-8 (a local store names it with a surrogate escape).
HOSTILE_NAMES = [
    "plain.bin",
    "ünï cödé/ファイル.bin",
    "new\nline\tand tab.bin",
    os.fsdecode(b"not-utf8-\xff\xfe.bin"),
    "..%2F..%00 quoted.bin",
]


def test_hostile_names_and_failures_cross_the_fetcher_pipe_unchanged(tmp_path):
    """Requests and answers cross the pipe packed, not pickled (cachefs/cluster/fetchers.py):
    a real fetcher process reads every hostile name from a real local store, into memory and
    into a file whose path is hostile too, byte for byte with the checksums of those bytes; a
    fetch that fails comes back with the error's kind and message, and so does one that raises
    something no store raises (the fetcher's thread would otherwise die and the request wait
    for ever)."""
    from cachefs.cache.base import checksum, chunk_checksums
    from cachefs.cluster.fetchers import FetcherPool, FetchFailed
    from cachefs.store import StoreConfig, open_store

    source = tmp_path / "source"
    expected = {}
    for number, name in enumerate(HOSTILE_NAMES):
        path = source / name
        path.parent.mkdir(parents=True, exist_ok=True)
        expected[name] = f"{number}:{name!r};".encode("utf-8", "surrogateescape") * 997
        path.write_bytes(expected[name])
    into = tmp_path / "into \n ü"
    into.mkdir()
    config = StoreConfig(uri=f"file://{source}")
    store = open_store(config)
    pool = FetcherPool(1)
    try:
        for number, (name, data) in enumerate(expected.items()):
            etag = store.head(name).etag
            assert pool.fetch(config, name, 0, len(data), etag).data == data
            target = into / f"{number}-{os.path.basename(name)}"
            written = pool.start_into(config, name, 1, len(data) - 1, etag, str(target))
            result = written.result(timeout=WAIT_S)
            assert target.read_bytes() == data[1:]
            assert result.checksum == checksum(data[1:])
            assert result.chunk_checksums == chunk_checksums(data[1:])
        missing = "gone ü \udcff.bin"
        try:
            pool.fetch(config, missing, 0, 1, "etag")
        except FetchFailed as exc:
            failure = exc
        else:
            raise AssertionError("fetching a missing object succeeded")
        assert failure.kind == "ObjectNotFound"
        assert "gone ü" in str(failure)
        # A request the fetcher cannot even start on (it cannot allocate the buffer) is still
        # answered: the worker waits for every request it sent.
        name, data = next(iter(expected.items()))
        etag = store.head(name).etag
        impossible = pool.start_into(config, name, 0, 1 << 62, etag, str(into / "impossible"))
        try:
            impossible.result(timeout=WAIT_S)
        except FetchFailed as exc:
            assert exc.kind == "MemoryError"
        else:
            raise AssertionError("an impossible fetch succeeded")
        assert pool.fetch(config, name, 0, len(data), etag).data == data  # the fetcher lives on
    finally:
        pool.close()
