"""`cachefs demo`: the whole single-node flow on a generated dataset, no cloud account needed.

Generates an ImageNet-like tree (class directories, log-normal file sizes around 110 KB) in a
local directory, starts a worker, adds the directory as a dataset, reads every file through the
mount three times, verifies every byte against the source, prints throughput and `cachefs
status`, and stops the worker (unless --keep).

The three reads show the three places bytes come from, and each says what cachefs counted: the
first from the source (misses), the second from cachefs's cache (hits; the kernel's page cache
of the files is dropped first, or the kernel would answer without asking cachefs), the third
from the kernel's page cache (cachefs counts nothing: the reads never reach it).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from cachefs.client import ControlClient


def generate_image_tree(
    root: str, *, files: int, classes: int = 100, mean_size: int = 110_000, seed: int = 0
) -> int:
    """Write ``files`` files of log-normal sizes (mean ≈ ``mean_size``) into ``classes`` class
    directories under ``root/train``. Deterministic for a seed; returns the bytes written.
    Existing files of the right size are kept (so re-runs are fast)."""
    rng = random.Random(seed)
    sigma = 0.6  # spread of ImageNet JPEG sizes
    mu = math.log(mean_size) - sigma**2 / 2  # so that the mean is mean_size
    total = 0
    for i in range(files):
        cls = f"n{1440764 + i % classes:08d}"
        size = max(1, int(rng.lognormvariate(mu, sigma)))
        data = rng.randbytes(size)  # drawn even when the file exists: the stream stays in step
        path = os.path.join(root, "train", cls, f"{cls}_{i:07d}.JPEG")
        total += size
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return total


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read_all(paths: list[str], threads: int = 4) -> tuple[float, int]:
    def read(path: str) -> int:
        with open(path, "rb") as f:
            return len(f.read())

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, paths))
    return time.perf_counter() - began, nbytes


def _drop_page_cache(paths: list[str]) -> None:
    """Make the kernel forget the cached pages of these files (clean pages of files nobody
    has mapped are dropped; no root needed), so the next read reaches cachefs."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _block_reads(client: ControlClient) -> dict[str, int]:
    """The worker's block-read counters: hits of its cache tiers, reads served from the
    block just fetched ("recent"), and misses (fetched from the source)."""
    reads = client.status()["reads"]
    hits = reads["hits"]
    return {
        "hits": hits.get("ram", 0) + hits.get("ssd", 0),
        "recent": hits.get("recent", 0),
        "misses": reads["misses"],
    }


def _counted(before: dict[str, int], after: dict[str, int], files: int) -> str:
    """What cachefs counted between two readings of :func:`_block_reads`, for a pass over
    ``files`` files of one block each."""
    hits, recent, misses = (after[k] - before[k] for k in ("hits", "recent", "misses"))
    seen = hits + recent + misses
    if seen == 0:
        return "cachefs saw none of these reads: the kernel's page cache served them all"
    counted = f"cachefs saw {seen} block reads: {hits} cache hits, {misses} misses"
    if recent:
        counted += f", {recent} of a block just fetched"
    counted += f" (hit ratio {hits / seen:.2f})"
    if seen < files:
        counted += "; the kernel's page cache served the rest"
    return counted


def run_demo(*, workdir: str, files: int, keep: bool, log_level: str = "INFO") -> int:
    source = os.path.join(workdir, "source")
    state = os.path.join(workdir, "state")
    mount = os.path.join(workdir, "mnt")
    print(f"1. generating {files} image-like files in {source}")
    total = generate_image_tree(source, files=files)

    print(f"2. starting the worker: cachefs --state {state} up --mount {mount} --ram 1GiB")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachefs",
            "--state",
            state,
            "--log-level",
            log_level,
            "up",
            "--mount",
            mount,
            "--ram",
            "1GiB",
            "--metrics",
            "off",
        ]
    )
    client = ControlClient(state)
    leave_running = False  # --keep, once the demo has passed
    try:
        for _ in range(300):
            if worker.poll() is not None:
                print("the worker exited early; see its log above", file=sys.stderr)
                return 1
            if client.is_running():
                break
            time.sleep(0.1)
        print(f"3. cachefs dataset add demo file://{source}")
        if any(d["name"] == "demo" for d in client.datasets()):
            client.remove_dataset("demo")
        added = client.add_dataset({"name": "demo", "uri": f"file://{source}"})
        print(f"   {added['files']} files, {added['bytes']} bytes in the snapshot")

        relative = sorted(
            os.path.relpath(os.path.join(d, f), source)
            for d, _, names in os.walk(source)
            for f in names
        )
        random.Random(1).shuffle(relative)
        mounted = [os.path.join(mount, "demo", p) for p in relative]
        passes = (
            ("first read (from the source)", False),
            ("second read (from the cachefs cache; the kernel's page cache dropped first)", True),
            ("third read (from the kernel's page cache)", False),
        )
        for label, drop_first in passes:
            if drop_first:
                _drop_page_cache(mounted)
            before = _block_reads(client)
            seconds, nbytes = _read_all(mounted)
            print(
                f"4. {label}: {len(mounted) / seconds:,.0f} files/s, "
                f"{nbytes / seconds / 1e6:,.0f} MB/s\n"
                f"   {_counted(before, _block_reads(client), len(mounted))}"
            )
            if nbytes != total:
                print(f"read {nbytes} bytes, expected {total}", file=sys.stderr)
                return 1

        bad = [
            p
            for p in relative
            if _sha256(os.path.join(source, p)) != _sha256(os.path.join(mount, "demo", p))
        ]
        print(f"5. verified {len(relative)} files byte-for-byte: {len(bad)} mismatches")
        status = client.status()
        reads = status["reads"]
        ds = status["datasets"][0]
        print(
            f"6. status: hit ratio {reads['hit_ratio']:.2f} since the worker started (its first "
            f"reads were misses), cached {ds['cached_fraction']:.0%} of the dataset, "
            f"RSS {status['rss_bytes'] >> 20} MiB"
        )
        if bad:
            return 1
        if keep:
            print(
                f"worker left running: ls {mount}/demo ; cachefs --state {state} status ; "
                f"cachefs --state {state} down"
            )
            leave_running = True
        return 0
    finally:
        if not leave_running:
            if client.is_running():
                client.shutdown()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        client.close()
