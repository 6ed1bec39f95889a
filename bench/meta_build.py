"""Benchmark: build an ImageNet-shaped namespace snapshot and measure reads from it.

The listing is synthetic but shaped like ImageNet-1k as S3 lists it: train/<wnid>/<wnid>_<n>.JPEG
for 1000 classes (1,281,167 files) and 50,000 flat files under val/, in ascending key order.
It is generated lazily and deterministically; at most one class's names are in memory.

Measures: build seconds (wall and CPU: the machine may be shared) and objects/s, snapshot size
on disk, peak RSS of this process after the build (and the current RSS split into heap and
mapped snapshot pages), a refresh build (previous snapshot given, 1 % of files changed, 0.1 %
removed, 0.1 % added), and the cost of 100k random resolve/lookup/getattr calls plus full and
kernel-style (30 entries per call) readdirs of class directories. The listing generator's own
time is included in the build times; it is also measured alone. Prints one JSON object, then a
table. From the repository root:

    python -m bench.meta_build [--classes 1000] [--val 50000] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import xxhash

from cachefs.meta import Snapshot, build_snapshot
from cachefs.store.base import ObjectInfo

TRAIN_FILES = 1_281_167
SEED = 20240601
BASE_MTIME_NS = 1_600_000_000 * 10**9
LOOKUPS = 100_000


def class_wnid(class_index: int) -> str:
    return f"n{1_440_764 + class_index * 1_000:08d}"


def class_file_count(class_index: int, classes: int) -> int:
    """Spread TRAIN_FILES (scaled to ``classes``) as evenly as ImageNet does (1281 or 1282)."""
    total = TRAIN_FILES * classes // 1000
    return total // classes + (1 if class_index < total % classes else 0)


def class_names(class_index: int, classes: int) -> list[str]:
    """File names of one class directory, sorted as S3 sorts them (by bytes)."""
    rng = random.Random(SEED + class_index)
    wnid = class_wnid(class_index)
    numbers = rng.sample(range(1, 60_000), class_file_count(class_index, classes))
    return sorted(f"{wnid}_{n}.JPEG" for n in numbers)


def object_for(key: str, version: int = 0) -> ObjectInfo:
    """Size, etag and mtime derived from the key (a hash: ~1 µs, unlike seeding a Random)."""
    digest = xxhash.xxh3_128_intdigest(key.encode(), seed=version)
    return ObjectInfo(
        key=key,
        size=20_000 + digest % 180_000,
        etag=f"{digest:032x}",
        mtime_ns=BASE_MTIME_NS + (digest >> 64) % 10**15,
    )


def imagenet_listing(
    classes: int, val_files: int, *, refresh: bool = False
) -> Iterator[ObjectInfo]:
    """The whole listing in key order. With ``refresh``, about 1 % of objects have a new version,
    0.1 % are gone and 0.1 % are new (a key with the suffix "x" after an existing one)."""
    keys = _all_keys(classes, val_files)
    for position, key in enumerate(keys):
        if not refresh:
            yield object_for(key)
            continue
        bucket = position % 1000
        if bucket == 7:
            continue  # removed
        yield object_for(key, version=1 if bucket < 10 else 0)
        if bucket == 11:
            yield object_for(key + "x")  # "....JPEG" < "....JPEGx" < the next name: still sorted


def _all_keys(classes: int, val_files: int) -> Iterator[str]:
    for class_index in range(classes):
        wnid = class_wnid(class_index)
        for name in class_names(class_index, classes):
            yield f"train/{wnid}/{name}"
    for n in range(1, val_files + 1):
        yield f"val/ILSVRC2012_val_{n:08d}.JPEG"


def random_paths(classes: int, count: int) -> list[str]:
    rng = random.Random(SEED)
    picks = sorted(rng.randrange(classes) for _ in range(count))
    paths = []
    names: list[str] = []
    current = -1
    for class_index in picks:
        if class_index != current:
            current = class_index
            names = class_names(class_index, classes)
        paths.append(f"train/{class_wnid(class_index)}/{rng.choice(names)}")
    rng.shuffle(paths)
    return paths


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_split_mb() -> dict[str, float]:
    """Current RSS split into anonymous memory (the heap) and mapped file pages (the LMDB
    map: clean page cache the kernel can take back), from /proc/self/status."""
    split = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                split[name] = int(value.split()[0]) / 1024
    return split


def disk_bytes(path: str) -> tuple[int, int]:
    """(apparent size, allocated bytes) of the files in a snapshot directory."""
    apparent = allocated = 0
    for entry in os.scandir(path):
        st = entry.stat()
        apparent += st.st_size
        allocated += st.st_blocks * 512
    return apparent, allocated


def per_call_us(calls: int, seconds: float) -> float:
    return seconds / calls * 1e6


def measure_reads(snapshot: Snapshot, classes: int) -> dict[str, float]:
    paths = random_paths(classes, LOOKUPS)
    t0 = time.perf_counter()
    entries = [snapshot.resolve(p) for p in paths]
    resolve_first_s = time.perf_counter() - t0  # includes faulting the map's pages in
    assert all(e is not None for e in entries), "a generated path is missing from the snapshot"
    t0 = time.perf_counter()
    for path in paths:
        snapshot.resolve(path)
    resolve_s = time.perf_counter() - t0

    pairs = [(e.parent, e.name) for e in entries]
    t0 = time.perf_counter()
    for parent, name in pairs:
        snapshot.lookup(parent, name)
    lookup_s = time.perf_counter() - t0

    inos = [e.ino for e in entries]
    t0 = time.perf_counter()
    for ino in inos:
        snapshot.getattr(ino)
    getattr_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for ino in inos:
        if snapshot.lookup(ino, b"missing") is not None:
            raise AssertionError("a file has children")
    miss_s = time.perf_counter() - t0

    train = snapshot.resolve("train")
    class_dirs = list(snapshot.readdir(train.ino))
    t0 = time.perf_counter()
    listed = sum(1 for d in class_dirs[:100] for _ in snapshot.readdir(d.ino))
    readdir_s = time.perf_counter() - t0

    # The kernel asks for ~30 entries per readdir call and resumes from the last child.
    first = class_dirs[0]
    t0 = time.perf_counter()
    resumed = 0
    after = 0
    while True:
        page = []
        for entry in snapshot.readdir(first.ino, after):
            page.append(entry)
            if len(page) == 30:
                break
        if not page:
            break
        resumed += len(page)
        after = page[-1].ino
    resume_s = time.perf_counter() - t0

    return {
        "resolve_first_touch_us": per_call_us(LOOKUPS, resolve_first_s),
        "resolve_us": per_call_us(LOOKUPS, resolve_s),
        "lookup_us": per_call_us(LOOKUPS, lookup_s),
        "getattr_us": per_call_us(LOOKUPS, getattr_s),
        "lookup_miss_us": per_call_us(LOOKUPS, miss_s),
        "readdir_us_per_entry": per_call_us(listed, readdir_s),
        "readdir_resumed_30_us_per_entry": per_call_us(resumed, resume_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--val", type=int, default=50_000)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to build")
    parser.add_argument("--keep", action="store_true", help="keep the snapshots")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="meta_build-", dir=args.dir)
    try:
        first_dir = os.path.join(work, "v1")
        cpu0 = time.process_time()
        for _ in imagenet_listing(args.classes, args.val):
            pass
        listing_cpu_s = time.process_time() - cpu0  # the generator alone, for comparison
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = build_snapshot(imagenet_listing(args.classes, args.val), first_dir)
        build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        rss_after_build = peak_rss_mb()
        rss_split_after_build = rss_split_mb()
        objects = result.stats.files + sum(result.stats.skipped.values())
        apparent, allocated = disk_bytes(first_dir)

        first = Snapshot.open(first_dir)
        t0, cpu0 = time.perf_counter(), time.process_time()
        refreshed = build_snapshot(
            imagenet_listing(args.classes, args.val, refresh=True),
            os.path.join(work, "v2"),
            previous=first,
        )
        refresh_s, refresh_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        rss_after_refresh = peak_rss_mb()
        rss_split_after_refresh = rss_split_mb()

        reads = measure_reads(first, args.classes)
        first.close()
        report = {
            "objects": objects,
            "files": result.stats.files,
            "dirs": result.stats.dirs,
            "build_s": build_s,
            "build_cpu_s": build_cpu_s,
            "listing_generator_cpu_s": listing_cpu_s,
            "objects_per_s": objects / build_s,
            "disk_bytes": apparent,
            "disk_allocated_bytes": allocated,
            "disk_bytes_per_object": apparent / objects,
            "peak_rss_mb_after_build": rss_after_build,
            "rss_anon_mb_after_build": rss_split_after_build["RssAnon"],
            "rss_file_mb_after_build": rss_split_after_build["RssFile"],
            "refresh_s": refresh_s,
            "refresh_cpu_s": refresh_cpu_s,
            "refresh_changed": len(refreshed.changed_inos),
            "refresh_removed": len(refreshed.removed),
            "refresh_files": refreshed.stats.files,
            "refresh_disk_bytes": disk_bytes(os.path.join(work, "v2"))[0],
            "peak_rss_mb_after_refresh": rss_after_refresh,
            "rss_anon_mb_after_refresh": rss_split_after_refresh["RssAnon"],
            "rss_file_mb_after_refresh": rss_split_after_refresh["RssFile"],
            **reads,
            "peak_rss_mb_after_reads": peak_rss_mb(),
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(json.dumps(report))
    width = max(len(k) for k in report)
    for name, value in report.items():
        shown = f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"
        print(f"{name:<{width}}  {shown:>16}")
    if args.keep:
        print(f"snapshots kept in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
