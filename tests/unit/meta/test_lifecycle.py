"""Opening, refusing and closing snapshots, and reading one from the trio loop and from threads
while a refresh is built and swapped in."""

from __future__ import annotations

import functools
import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import lmdb
import pytest
import trio

import cachefs
from cachefs.meta import ROOT, Snapshot, SnapshotError, build_snapshot
from cachefs.store.base import ObjectInfo
from tests.unit.meta.model import dump

REPO_ROOT = Path(cachefs.__file__).resolve().parent.parent


def obj(key: str) -> ObjectInfo:
    return ObjectInfo(key=key, size=len(key), etag=f"etag-{key}", mtime_ns=len(key))


def test_a_build_killed_midway_is_refused(tmp_path) -> None:
    """kill -9 after the first transactions were committed: the directory holds a real,
    partly written environment, and Snapshot.open must not serve it."""
    dest = tmp_path / "snap"
    child = textwrap.dedent(
        f"""
        import sys, time
        from cachefs.meta import build_snapshot
        from cachefs.store.base import ObjectInfo

        def listing():
            for i in range(60_000):  # the first 50,000 entries are committed by now
                yield ObjectInfo(f"d/{{i:06d}}", 1, "e", 1)
            print("committed", flush=True)
            time.sleep(600)  # killed long before this ends
            yield ObjectInfo("never", 1, "e", 1)

        build_snapshot(listing(), {str(dest)!r})
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout.readline() == "committed\n"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert (dest / "data.mdb").stat().st_size > 1_000_000
    with pytest.raises(SnapshotError, match="is incomplete"):
        Snapshot.open(dest)


def test_what_is_not_a_snapshot_is_refused(tmp_path) -> None:
    with pytest.raises(SnapshotError, match=r"no snapshot at .*data\.mdb does not exist"):
        Snapshot.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotError, match="no snapshot"):
        Snapshot.open(tmp_path / "empty")

    env = lmdb.open(str(tmp_path / "other"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"some", b"thing")
    env.close()
    with pytest.raises(SnapshotError, match="not a cachefs snapshot"):
        Snapshot.open(tmp_path / "other")

    build_snapshot([obj("a")], tmp_path / "future")
    env = lmdb.open(str(tmp_path / "future"), max_dbs=3, lock=False)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format", b"99")
    env.close()
    with pytest.raises(SnapshotError, match=r"format b'99'.*rebuild it"):
        Snapshot.open(tmp_path / "future")


def test_close_lets_calls_in_flight_finish(tmp_path) -> None:
    build_snapshot([obj(f"d/{i:04d}") for i in range(500)], tmp_path / "snap")
    first = Snapshot.open(tmp_path / "snap")
    second = Snapshot.open(tmp_path / "snap")  # shares the environment with `first`
    d = first.resolve("d")
    listing = first.readdir(d.ino)
    head = list(itertools.islice(listing, 10))

    first.close()
    with pytest.raises(SnapshotError, match="is closed"):
        first.getattr(ROOT)
    with pytest.raises(SnapshotError, match="is closed"):
        first.readdir(ROOT)
    # An iterator handed out before close() still completes; the other handle still serves.
    assert len(head) + len(list(listing)) == 500
    assert second.resolve("d/0499").size == len("d/0499")
    first.close()  # closing twice is harmless
    second.close()
    third = Snapshot.open(tmp_path / "snap")
    assert third.getattr(ROOT).nlink == 3
    third.close()


async def test_readers_on_trio_and_threads_while_a_refresh_is_built_and_swapped(tmp_path) -> None:
    """The FUSE core's pattern: calls inline on the trio loop and from worker threads, a refresh
    built in a thread with the served snapshot as `previous`, then swapped in and the old one
    closed while readers are still running."""
    old_objects = [obj(f"class{c:02d}/img{i:04d}.jpg") for c in range(20) for i in range(400)]
    new_objects = old_objects + [obj(f"class20/img{i:04d}.jpg") for i in range(3000)]
    build_snapshot(old_objects, tmp_path / "old")
    served = {"snapshot": Snapshot.open(tmp_path / "old")}
    inos = {path: entry.ino for path, entry in dump(served["snapshot"]).items()}
    paths = [info.key for info in old_objects]
    swapped = threading.Event()
    reads_after_swap_wanted = 300
    errors: list[BaseException] = []

    def read_once(rng: random.Random) -> None:
        snapshot = served["snapshot"]
        path = rng.choice(paths)
        try:
            entry = snapshot.resolve(path)
            assert entry is not None and entry.key == path and entry.size == len(path)
            assert entry.ino == inos[path], "inode changed across the refresh"
            assert snapshot.getattr(entry.ino) == entry
            page = [e.name for e in itertools.islice(snapshot.readdir(entry.parent), 40)]
            assert page == sorted(page) and len(page) == 40
        except SnapshotError as err:
            assert "is closed" in str(err)  # raced with the swap; the next call uses the new one

    def thread_reader(seed: int) -> None:
        rng = random.Random(seed)
        after_swap = 0
        for _ in range(1_000_000):  # bounded; ends long before
            try:
                read_once(rng)
            except BaseException as err:
                errors.append(err)
                return
            if swapped.is_set():
                after_swap += 1
                if after_swap == reads_after_swap_wanted:
                    return

    async def loop_reader(seed: int) -> None:
        rng = random.Random(seed)
        after_swap = 0
        for _ in range(1_000_000):
            read_once(rng)  # inline on the trio loop, as the FUSE handlers do
            await trio.sleep(0)
            if swapped.is_set():
                after_swap += 1
                if after_swap == reads_after_swap_wanted:
                    return

    async with trio.open_nursery() as nursery:
        for seed in range(3):
            nursery.start_soon(loop_reader, seed)
        for seed in range(3, 7):
            nursery.start_soon(trio.to_thread.run_sync, thread_reader, seed)
        refresh = functools.partial(
            build_snapshot, new_objects, tmp_path / "new", previous=served["snapshot"]
        )
        result = await trio.to_thread.run_sync(refresh)
        old, served["snapshot"] = served["snapshot"], Snapshot.open(tmp_path / "new")
        old.close()
        swapped.set()

    assert errors == []
    assert result.stats.files == len(new_objects) and result.removed == []
    assert served["snapshot"].resolve("class20/img2999.jpg") is not None
    served["snapshot"].close()


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total = 0
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                inside = len(head) == 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_unmapping_a_snapshots_pages_drops_them_from_rss_and_reads_stay_right(tmp_path) -> None:
    """Reading every record maps the snapshot's file into this process; unmap_pages() drops
    those mappings' resident pages to nothing, and every listing reads the same afterwards (the
    pages come back from the page cache)."""
    dest = tmp_path / "snap"
    build_snapshot([obj(f"d{i % 40}/file-{i:06d}.bin") for i in range(20_000)], str(dest))
    snapshot = Snapshot.open(dest)
    data_file = os.path.realpath(dest / "data.mdb")
    try:

        def every_listing() -> list:
            listed = []
            for directory in snapshot.readdir_fields(ROOT):
                listed.append(directory)
                listed.extend(snapshot.readdir_fields(directory[1]))
            return listed

        before = every_listing()
        assert len(before) == 40 + 20_000
        assert _mapped_kib(data_file) > 256  # the records read are mapped (the file is ~3 MB)
        assert snapshot.unmap_pages() >= os.path.getsize(data_file)
        assert _mapped_kib(data_file) == 0
        assert every_listing() == before
        assert _mapped_kib(data_file) > 256  # mapped again by the reads
    finally:
        snapshot.close()
    with pytest.raises(SnapshotError, match="closed"):  # never advice on an unmapped range
        snapshot.unmap_pages()
