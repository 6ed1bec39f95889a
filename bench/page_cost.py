"""What a new page costs on this machine, against reusing one: a fact behind FUSE first reads.

    python -m bench.page_cost [--files 3000] [--size 110KB] [--dir /dev/shm] [--repeats 3]

A first read through the mount lands in page-cache pages the kernel allocates for the FUSE
file, and a block the cache admits into its RAM tier is written into new tmpfs pages; a read
of the same file on tmpfs, the benchmarks' reference, allocates nothing. On a virtual machine
whose kernel hands freed memory back to its host (free page reporting, a balloon), taking a
page the host has reclaimed costs microseconds (the host maps it in again), where a bare-metal
kernel spends a fraction of one. This bench measures, side by side in one run, best of
``--repeats``:

* ``create_write``: ``--files`` new files of ``--size`` bytes created and written on ``--dir``
  (tmpfs), then removed: per file and per 4 KiB page;
* ``overwrite``: the same bytes written over one existing file as often (no page allocated):
  what the same write costs without new pages;
* ``anon``: a fresh anonymous mapping of ``--size`` bytes filled and unmapped, as often;

and reports whether free page reporting is on (``/sys/module/page_reporting``): its order and
how much memory it has reported to the host so far.

Output: JSON (stdout) and a table (stderr). Nothing is asserted; nothing here is imported by
cachefs. Reference (bench/results/page_cost/2026-12-01.md): on the 2-core VM of the
benchmarks, with reporting on, ``create_write`` ~60 µs per 110 KB file against ~9 µs for
``overwrite``.

``back_free_pages`` is the remedy the cluster and native-read benches use (``--back-pages``):
memory taken and given back right before a pass, so that its page cache lands on pages the
host backs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

from cachefs.units import parse_size

PAGE = os.sysconf("SC_PAGE_SIZE")
REPORTING = "/sys/module/page_reporting/parameters"


def page_reporting() -> dict:
    """Free page reporting's settings and totals, where the kernel has it (else ``on``: False)."""
    if not os.path.isdir(REPORTING):
        return {"on": False}
    found: dict = {"on": True}
    for name in ("page_reporting_order", "reported_kib"):
        try:
            with open(os.path.join(REPORTING, name)) as f:
                found[name] = int(f.read().strip())
        except (OSError, ValueError):
            found[name] = None
    return found


def create_write(where: str, data: bytes, files: int) -> float:
    """Seconds per file to create and write ``files`` new files (removed afterwards)."""
    paths = [os.path.join(where, f"f{i}") for i in range(files)]
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
    elapsed = time.perf_counter() - started
    for path in paths:
        os.unlink(path)
    return elapsed / files


def overwrite(where: str, data: bytes, times: int) -> float:
    """Seconds per write of ``data`` over one existing file's pages."""
    path = os.path.join(where, "kept")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
        started = time.perf_counter()
        for _ in range(times):
            os.pwrite(fd, data, 0)
        return (time.perf_counter() - started) / times
    finally:
        os.close(fd)
        os.unlink(path)


def anon(data: bytes, times: int) -> float:
    """Seconds per fresh anonymous mapping of ``len(data)`` bytes filled with it."""
    length = -(-len(data) // PAGE) * PAGE
    started = time.perf_counter()
    for _ in range(times):
        mapping = mmap.mmap(-1, length)
        mapping[: len(data)] = data
        mapping.close()
    return (time.perf_counter() - started) / times


#: What :func:`back_free_pages` leaves of the memory available.
BACK_PAGES_MARGIN = 1 << 30
#: Backed before a pass beyond 1.25x its bytes (:func:`back_pages_for_pass`).
BACK_PAGES_SLACK = 64 << 20


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def back_free_pages(nbytes: int) -> float:
    """Take ``nbytes`` of free memory and give it back at once (an anonymous mapping, every
    page written, unmapped): seconds taken. The kernel's next allocations take those pages
    first (freed last), and the host backs them again, so a benchmark pass that fills that much
    page cache right after pays what a bare-metal kernel pays for a page, not the host's fault
    for a page it took back (free page reporting). On a machine without reporting this only
    costs the time. Used by bench/cluster_bench.py (``--back-pages``). Never more than the
    memory available now less :data:`BACK_PAGES_MARGIN` (this memory cannot be reclaimed while
    it is held: more could make the kernel kill the bench, which then leaves its processes
    behind), nothing if that leaves none."""
    length = -(-min(nbytes, available_bytes() - BACK_PAGES_MARGIN) // PAGE) * PAGE
    if length <= 0:
        return 0.0
    started = time.perf_counter()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(-1, length, flags=flags)
    try:
        if not getattr(mmap, "MAP_POPULATE", 0):
            for offset in range(0, length, PAGE):
                mapping[offset] = 1
    finally:
        mapping.close()
    return time.perf_counter() - started


def back_pages_for_pass(pass_bytes: int) -> float:
    """:func:`back_free_pages` sized for a pass that reads ``pass_bytes`` into the page cache:
    1.25x them and :data:`BACK_PAGES_SLACK` more (what the benches' ``--back-pages`` does after
    each ``drop_caches``); seconds taken."""
    return back_free_pages(pass_bytes * 5 // 4 + BACK_PAGES_SLACK)


def measure(where: str, size: int, files: int, repeats: int) -> dict:
    data = os.urandom(size)
    pages = -(-size // PAGE)
    runs: dict[str, list[float]] = {"create_write": [], "overwrite": [], "anon": []}
    scratch = tempfile.mkdtemp(prefix="page-cost-", dir=where)
    try:
        for _ in range(repeats):  # interleaved, so that a change of the machine's pace shows
            runs["create_write"].append(create_write(scratch, data, files))
            runs["overwrite"].append(overwrite(scratch, data, files))
            runs["anon"].append(anon(data, files))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {
        name: {"us_per_op": 1e6 * min(values), "us_per_page": 1e6 * min(values) / pages}
        for name, values in runs.items()
    }
    return {
        "dir": where,
        "size": size,
        "pages": pages,
        "files": files,
        "repeats": repeats,
        "rows": rows,
        "all_us_per_op": {name: [1e6 * v for v in values] for name, values in runs.items()},
        "new_page_us": (rows["create_write"]["us_per_op"] - rows["overwrite"]["us_per_op"]) / pages,
        "page_reporting": page_reporting(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.page_cost", description=__doc__)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", default="110KB")
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory to write in")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure(args.dir, parse_size(args.size), args.files, args.repeats)
    print(json.dumps(result))
    print(f"| op ({result['size']:,} bytes, best of {args.repeats}) | µs per op | µs per page |",
          file=sys.stderr)  # fmt: skip
    print("|---|---:|---:|", file=sys.stderr)
    for name, row in result["rows"].items():
        print(f"| {name} | {row['us_per_op']:.1f} | {row['us_per_page']:.2f} |", file=sys.stderr)
    print(f"a new page costs ~{result['new_page_us']:.2f} µs more than a kept one; "
          f"page reporting: {result['page_reporting']}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
