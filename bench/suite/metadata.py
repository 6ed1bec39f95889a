"""The metadata workload: an ImageNet-shaped namespace of empty files, and how fast a data path
walks, ``find``s and ``stat``s it.

The namespace is ``train/<wnid>/<wnid>_<n>.JPEG``; with 1,281,167 entries every class holds
exactly as many files as ImageNet's (``bench.meta_build``), otherwise the entries are spread
over the classes the same way. Files hold no bytes: only names and attributes are measured.

Counting convention (``expected_counts`` and ``walk`` agree): the root directory itself is not
counted; ``train`` and every class directory holding at least one file are.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from bench.meta_build import TRAIN_FILES, class_file_count, class_wnid
from bench.read_bench import BenchmarkFailure, drop_page_cache

#: How many random files the stat pass looks at (fewer when the namespace is smaller).
STAT_SAMPLE = 10_000
STAT_SEED = 0
#: The /proc/PID/status fields process_rss reports (all in kB there).
RSS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


# --- the namespace ---------------------------------------------------------------------------


def class_counts(entries: int, classes: int = 1000) -> list[int]:
    """Files per class: ImageNet's own counts for the full 1,281,167, else an even spread
    (the first ``entries % classes`` classes get one more, as ImageNet's do)."""
    if entries < 1:
        raise ValueError(f"a namespace needs at least one entry, got {entries}")
    if entries == TRAIN_FILES and classes == 1000:
        return [class_file_count(index, classes) for index in range(classes)]
    return [entries // classes + (index < entries % classes) for index in range(classes)]


def namespace_keys(entries: int, *, classes: int = 1000) -> Iterator[str]:
    """Every key of the namespace, class by class, ``entries`` in all."""
    for index, count in enumerate(class_counts(entries, classes)):
        wnid = class_wnid(index)
        for n in range(1, count + 1):
            yield f"train/{wnid}/{wnid}_{n}.JPEG"


def expected_counts(entries: int, *, classes: int = 1000) -> tuple[int, int]:
    """(files, directories) of the namespace: directories are ``train`` plus the non-empty
    class directories; the root is not counted (as in ``walk``)."""
    non_empty_classes = sum(1 for count in class_counts(entries, classes) if count)
    return entries, 1 + non_empty_classes


def make_local_namespace(root: str, entries: int) -> int:
    """Create the namespace under ``root`` as empty files; return how many were created.

    ``root + ".complete"`` (outside the tree, so walks never see it) records a finished tree of
    ``entries`` files: with it in place this returns 0 at once. A tree without it (an
    interrupted run, another size) is removed and made again.
    """
    marker = root + ".complete"
    if _read_marker(marker) == entries:
        return 0
    shutil.rmtree(root, ignore_errors=True)
    created_dirs: set[str] = set()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for key in namespace_keys(entries):
        directory, _, _ = key.rpartition("/")
        if directory not in created_dirs:
            os.makedirs(os.path.join(root, directory), exist_ok=True)
            created_dirs.add(directory)
        os.close(os.open(os.path.join(root, key), flags, 0o644))
    with open(marker, "w") as out:
        out.write(f"{entries}\n")
    return entries


def _read_marker(marker: str) -> int | None:
    try:
        with open(marker) as text:
            return int(text.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def upload_namespace(client, bucket: str, prefix: str, entries: int, threads: int = 16) -> int:
    """PUT every key of the namespace as a zero-byte object ``prefix + key``; return the count.

    ``client`` is a boto3 S3 client (thread-safe); the bucket must exist.
    """

    def put(key: str) -> None:
        client.put_object(Bucket=bucket, Key=prefix + key, Body=b"")

    with ThreadPoolExecutor(threads) as pool:
        return sum(1 for _ in pool.map(put, namespace_keys(entries)))


# --- measuring -------------------------------------------------------------------------------


def process_rss(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of a process, in bytes."""
    rss = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in RSS_FIELDS:
                rss[name] = int(value.split()[0]) * 1024
    return rss


def walk(root: str, keep: frozenset[int] = frozenset()) -> tuple[dict, list[str]]:
    """``os.scandir`` every directory below ``root`` and ``os.lstat`` every entry.

    Returns the timing and counts, and the paths of the files whose position in the walk is in
    ``keep`` (the stat pass's sample, taken without holding every path in memory).
    """
    files = dirs = 0
    kept: list[str] = []
    pending = [root]
    began = time.perf_counter()
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                mode = os.lstat(entry.path).st_mode
                if stat.S_ISDIR(mode):
                    dirs += 1
                    pending.append(entry.path)
                elif stat.S_ISREG(mode):
                    if files in keep:
                        kept.append(entry.path)
                    files += 1
    seconds = time.perf_counter() - began
    counts = {"entries": files + dirs, "files": files, "dirs": dirs, "seconds": seconds}
    counts["entries_per_s"] = counts["entries"] / seconds if seconds else 0.0
    return counts, kept


def find_files(root: str) -> dict:
    """``find ROOT -type f``, its output lines counted."""
    began = time.perf_counter()
    result = subprocess.run(["find", root, "-type", "f"], capture_output=True, check=False)
    seconds = time.perf_counter() - began
    if result.returncode != 0:
        raise BenchmarkFailure(f"find {root} failed: {result.stderr.decode(errors='replace')}")
    return {"seconds": seconds, "files": result.stdout.count(b"\n")}


def stat_files(paths: list[str]) -> dict:
    began = time.perf_counter()
    for path in paths:
        os.stat(path)
    seconds = time.perf_counter() - began
    return {
        "files": len(paths),
        "seconds": seconds,
        "files_per_s": len(paths) / seconds if seconds else 0.0,
    }


def measure_namespace(root: str, expected_files: int, expected_dirs: int) -> dict:
    """Walk cold (page cache, dentries and inodes dropped) and warm, ``find`` cold, and
    ``stat`` a seeded random sample of files. A count other than expected raises
    BenchmarkFailure: a number from a partial listing is no number."""
    sample_size = min(STAT_SAMPLE, expected_files)
    keep = frozenset(random.Random(STAT_SEED).sample(range(expected_files), sample_size))
    drop_page_cache()
    walk_cold, _ = walk(root)
    walk_warm, sample = walk(root, keep)
    expected = {"files": expected_files, "dirs": expected_dirs}
    _check_counts(root, "the cold walk", walk_cold, expected)
    _check_counts(root, "the warm walk", walk_warm, expected)
    drop_page_cache()
    found = find_files(root)
    _check_counts(root, "find", found, {"files": expected_files})
    random.Random(STAT_SEED).shuffle(sample)  # not in directory order: no readdir locality
    return {
        "walk_cold": walk_cold,
        "walk_warm": walk_warm,
        "find": found,
        "stat": stat_files(sample),
    }


def _check_counts(root: str, what: str, seen: dict, expected: dict) -> None:
    """BenchmarkFailure unless every count in ``expected`` is what ``seen`` holds."""
    if any(seen[name] != count for name, count in expected.items()):
        raise BenchmarkFailure(f"{what} of {root} saw {seen}; expected {expected}")
