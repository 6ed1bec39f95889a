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
    except FileNotFoundError:
        return False


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
