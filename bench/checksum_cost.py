"""What verifying every byte served costs: CPU per GB of chunk verification, and the share of one
core that takes at a given read rate (the budget: a few % of a core at 2 GB/s).

    .venv/bin/python -m bench.checksum_cost                      # prints JSON, then a table
    .venv/bin/python -m bench.checksum_cost --out bench/results/checksum/<date>

Two measurements, each the median of ``--repeats`` runs, CPU time of the measuring thread
(``time.thread_time``: other processes on a loaded machine do not count, though they still share
its caches):

* ``verify``: the check itself, ``cachefs.cache.base.first_bad_chunk`` over a ``--buffer`` of
  data, chunk by chunk, for each of ``--chunk-sizes`` (the cache uses ``CHUNK_SIZE``): what one
  GB of reads costs in hashing and comparing. The default buffer is one block (4 MiB), which a
  read path hashes right after copying it (in the CPU's caches); a buffer much larger than the
  caches (``--buffer 256MiB``) measures hashing at memory speed instead.
* ``read``: ``TieredBlockCache.read`` of aligned ``CHUNK_SIZE`` ranges (what FUSE asks for) of
  ``--blocks`` 4 MiB blocks in a RAM tier on tmpfs, with the chunk check and with it replaced
  by a no-op: the cost of the whole RAM-tier read path (index lookup, pread, check, slice) and
  the part of it that verification adds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import xxhash

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache import tiered as tiered_module
from cachefs.cache.base import CHUNK_SIZE, BlockKey, chunk_checksums, first_bad_chunk
from cachefs.errors import ConfigError
from cachefs.protocol import DEFAULT_BLOCK_SIZE
from cachefs.units import format_size, parse_size

GB = 10**9


def cpu_seconds(work: Callable[[], int]) -> tuple[float, int]:
    """CPU seconds of this thread spent in ``work()`` and the bytes it says it processed."""
    start = time.thread_time()
    nbytes = work()
    return time.thread_time() - start, nbytes


def measure(name: str, work: Callable[[], int], repeats: int, rate: float, **details) -> dict:
    return summary(name, [cpu_seconds(work) for _ in range(repeats)], rate, **details)


def summary(name: str, runs: list[tuple[float, int]], rate: float, **details) -> dict:
    per_gb = statistics.median(seconds / nbytes * GB for seconds, nbytes in runs)
    return {
        "name": name,
        **details,
        "bytes_per_run": runs[0][1],
        "cpu_s_per_gb": per_gb,
        "gb_per_cpu_s": 1 / per_gb,
        "core_share_at_rate": per_gb * rate / GB,
    }


def verify_work(buffer: bytes, chunk_size: int, total: int) -> Callable[[], int]:
    """Verify ``buffer`` chunk by chunk until ``total`` bytes are checked."""
    sums = chunk_checksums(buffer, chunk_size)
    view = memoryview(buffer)

    def work() -> int:
        done = 0
        while done < total:
            for start in range(0, len(view), chunk_size):
                chunk = view[start : start + chunk_size]
                if first_bad_chunk(chunk, sums, start // chunk_size, chunk_size) is not None:
                    raise AssertionError("the benchmark's own data failed its check")
            done += len(view)
        return done

    return work


def read_work(cache: TieredBlockCache, keys: list[BlockKey], total: int) -> Callable[[], int]:
    """Read the blocks in aligned CHUNK_SIZE ranges until ``total`` bytes are read."""

    def work() -> int:
        done = 0
        while done < total:
            for key in keys:
                for offset in range(0, DEFAULT_BLOCK_SIZE, CHUNK_SIZE):
                    data = cache.read(key, offset, CHUNK_SIZE, tier="ram")
                    if data is None or len(data) != CHUNK_SIZE:
                        raise AssertionError("a cached block was not served")
                    done += len(data)
        return done

    return work


def run(args: argparse.Namespace) -> dict:
    rate = args.rate
    buffer = os.urandom(args.buffer)
    results = [
        measure(
            "verify",
            verify_work(buffer, chunk_size, args.total),
            args.repeats,
            rate,
            chunk_size=chunk_size,
        )
        for chunk_size in args.chunk_sizes
    ]
    workdir = tempfile.mkdtemp(prefix="cachefs-checksum-cost-", dir=args.tmpfs)
    try:
        ram = TierConfig("ram", os.path.join(workdir, "ram"), 2 * args.blocks * DEFAULT_BLOCK_SIZE)
        with TieredBlockCache(os.path.join(workdir, "index"), [ram]) as cache:
            keys = [BlockKey.make(1, f"bench/{i}", "etag", 0) for i in range(args.blocks)]
            for key in keys:
                cache.put(key, os.urandom(DEFAULT_BLOCK_SIZE))
            work = read_work(cache, keys, args.total)
            work()  # warm: descriptors kept open, pages touched
            # Alternated, so that a machine whose load changes during the runs weighs on both.
            checked_runs, unchecked_runs = [], []
            for _ in range(args.repeats):
                checked_runs.append(cpu_seconds(work))
                with mock.patch.object(tiered_module, "first_bad_chunk", lambda *_a, **_k: None):
                    unchecked_runs.append(cpu_seconds(work))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    verified = summary("read", checked_runs, rate, chunk_size=CHUNK_SIZE)
    unverified = summary("read, check replaced by a no-op", unchecked_runs, rate, chunk_size=None)
    added = verified["cpu_s_per_gb"] - unverified["cpu_s_per_gb"]
    results += [verified, unverified]
    return {
        "machine": machine(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench.checksum_cost"])
        + "".join(f" {arg}" for arg in sys.argv[1:]),
        "rate_bytes_per_s": rate,
        "chunk_size": CHUNK_SIZE,
        "results": results,
        "read_path_verification": {
            "cpu_s_per_gb": added,
            "core_share_at_rate": added * rate / GB,
            "share_of_read_path": added / verified["cpu_s_per_gb"],
        },
    }


def machine() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = (line.split(":", 1)[1] for line in cpuinfo if line.startswith("model name"))
            model = next(names, model).strip()
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "xxhash": f"{xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION})",
        "kernel": platform.release(),
    }


def render_markdown(report: dict) -> str:
    rate = report["rate_bytes_per_s"] / GB
    lines = [
        f"| measurement | chunk | CPU s per GB | GB per CPU s | share of a core at {rate:g} GB/s |",
        "|---|---|---|---|---|",
    ]
    for row in report["results"]:
        chunk = "-" if row["chunk_size"] is None else format_size(row["chunk_size"])
        lines.append(
            f"| {row['name']} | {chunk} | {row['cpu_s_per_gb']:.4f} | "
            f"{row['gb_per_cpu_s']:.1f} | {100 * row['core_share_at_rate']:.2f} % |"
        )
    added = report["read_path_verification"]
    lines.append(
        f"| verification in the read path (difference) | {format_size(report['chunk_size'])} | "
        f"{added['cpu_s_per_gb']:.4f} | - | {100 * added['core_share_at_rate']:.2f} % |"
    )
    m = report["machine"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, load average {m['load_average_at_start']:.2f} "
        f"at the start, Python {m['python']}, xxhash {m['xxhash']}, kernel {m['kernel']}.",
        f"Command: `{report['command']}`",
    ]
    return "\n".join(lines) + "\n"


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.checksum_cost", description=__doc__)
    parser.add_argument("--total", type=size, default=2 << 30,
                        help="bytes checked per run and measurement (default 2GiB)")  # fmt: skip
    parser.add_argument("--buffer", type=size, default=DEFAULT_BLOCK_SIZE,
                        help="verify: bytes hashed in a row (default 4MiB, one block)")  # fmt: skip
    parser.add_argument("--chunk-sizes", default=f"64KiB,{CHUNK_SIZE // 1024}KiB,1MiB",
                        type=lambda text: [size(part) for part in text.split(",")],
                        help="verify: chunk sizes (default 64KiB,128KiB,1MiB)")  # fmt: skip
    parser.add_argument("--blocks", type=int, default=32,
                        help="read: 4 MiB blocks in the RAM tier (default 32)")  # fmt: skip
    parser.add_argument("--rate", type=size, default=2 * GB,
                        help="read rate for the core share, bytes/s (default 2e9)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="where the RAM tier lives")
    parser.add_argument("--out", help="also write checksum_cost.json and .md into this directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    table = render_markdown(report)
    print(json.dumps(report, indent=1))
    print(table, file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "checksum_cost.json"), "w") as out:
            json.dump(report, out, indent=1)
            out.write("\n")
        with open(os.path.join(args.out, "checksum_cost.md"), "w") as out:
            out.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
