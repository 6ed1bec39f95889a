"""The native READ path against the Python one and tmpfs, side by side in one run.

    python -m bench.native_read_bench [--files 10000] [--readers 1,4,16] [--repeats 3]
                                      [--large-files 4 --large-mib 256] [--save-dir DIR]

Two cachefs workers (``cachefs up``) serve the same generated ImageNet-like tree (bench/datagen.py,
``file://`` source, RAM tier larger than the data): ``native`` with the patched pyfuse3's fast
path (``--fuse-fast-read on``), ``python`` with ``--fuse-fast-read off``, where every READ is
served by the Python handler — the path before the fast path, and what a stock pyfuse3 gives —
and ``passthrough``, the native path with ``--fuse-passthrough on``: the kernel reads a cached
small file's block file itself (FUSE passthrough), the worker answers its OPEN and RELEASE in C.
``--systems`` picks which of them run (default: all three).
``tmpfs`` is a plain copy of the tree on /dev/shm: the machine's limit. Passes, best of
``--repeats``, every reader count of ``--readers``:

* ``first_read_ram`` — every block in the RAM tier; the tree listed (dentries cached), then
  ``echo 1 > drop_caches`` (page cache dropped, dentries kept, as a training job lists and then
  reads); N reader *processes* (like DataLoader workers) each ``os.open``/``os.read``/``os.close``
  their share of one shuffled order. The worker's CPU time per 1,000 files is measured from
  /proc over the pass.
* ``first_read_ram_threads`` — the same with N threads in one process (the GIL caps tmpfs).
* ``first_read_ram_echo3`` — ``echo 3`` instead: dentries dropped too (LOOKUP + READ per file).
* ``warm`` — page cache kept (everything read just before): what neither path should change.
* ``first_read_source`` — nothing cached (dataset removed and added again, page cache dropped):
  every file fetched from the source through the worker (processes).
* ``large_first_read_ram`` — ``--large-files`` files of ``--large-mib`` MiB in the RAM tier,
  page cache dropped, one reader, MB/s (``--large-files 0``: no such pass).

After the ``drop_caches`` of the ``first_read_ram*`` and ``large_first_read_ram`` passes the
bench takes 1.25x the pass's bytes of memory and gives it back (``--back-pages``, on by default;
``bench.page_cost.back_free_pages``): on a VM that hands free memory back to its host, a page
the host took back costs a host fault when the pass's page cache is written into it, which a
bare-metal kernel never pays and tmpfs, reading pages it holds, never meets.
``--no-back-pages`` measures the pages as the kernel hands them out.
* ``ls_lR`` and ``find`` of the tree, warm (run once untimed first): seconds.
* ``walk_cold_first`` / ``walk_cold_second`` (with ``--walk N``) — an ImageNet-shaped namespace
  of N empty files (bench/suite/metadata.py) walked (scandir + lstat of every entry) after
  ``echo 3``: the first walk after the dataset is added (cachefs lists every directory in
  Python and registers its listing in C), then a second one (listings answered in C); the
  native worker's RSS after them. tmpfs's copy is removed before the worker's walks (tmpfs
  keeps its dentries through ``echo 3``, and the kernel's dentry hash table is shared), and
  each row records the dentries cached before it and the machine's hash table sizes when the
  boot command line fixes them.
* ``emulator_drop_pages`` (with ``--emulator N``) — the training-input emulator (bench/emulator.py,
  MLPerf ResNet-50 shape at ``--emulator-scale``) on N samples, tmpfs and every worker, the
  samples listed and the page cache dropped before each trial (``--drop-pages``): the largest
  number of accelerators kept >= 90 % busy.

Every read is checked: every file's length, and the sha256 of a fixed sample of the small files
against the generator; large files are read into one reused buffer and every
``LARGE_CHECK_EVERY``-th MiB is checked by xxh3 against the generator's (a sha256 of every byte
ran at ~570 MB/s here and made the reader, not the path, the limit). Output: JSON and a
markdown table with each cachefs number as a ratio to tmpfs; ``--save-dir`` writes
``<dir>/<date>.json|md``. Needs root (FUSE mounts, drop_caches). Nothing here is imported by
cachefs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import xxhash

from bench import emulator
from bench.datagen import file_bytes, plan_dataset, write_local
from bench.page_cost import back_pages_for_pass
from bench.read_bench import (
    BenchmarkFailure,
    WorkerProcess,
    describe_machine,
    lock_workdir,
    read_pass,
    run_and_report,
)
from bench.suite import metadata

SMALL = "small"
LARGE = "large"
SAMPLES = "samples"
NAMES = "names"
#: The cachefs workers this bench can compare, and their options.
WORKER_OPTIONS = {
    "passthrough": ["--fuse-fast-read", "on", "--fuse-passthrough", "on"],
    "native": ["--fuse-fast-read", "on", "--fuse-passthrough", "off"],
    # The native path served by two processes (cachefs/fs/serving.py).
    "native-2p": ["--fuse-fast-read", "on", "--fuse-passthrough", "off", "--fuse-processes", "2"],
    "python": ["--fuse-fast-read", "off"],
}
_LARGE_SEED = 1616
#: Large files: one MiB of every this many is checked (xxh3) while the pass reads.
LARGE_CHECK_EVERY = 8
_MIB = 1 << 20


# --- caches ----------------------------------------------------------------------------------


def drop_caches(level: int, pass_bytes: int = 0) -> None:
    """``echo level > drop_caches``: 1 = page cache, 3 = page cache, dentries and inodes; then,
    for a next pass reading ``pass_bytes`` (``--back-pages``), memory taken and given back so
    that its page cache lands on pages the VM's host backs (``bench.page_cost``)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write(f"{level}\n")
    if pass_bytes:
        back_pages_for_pass(pass_bytes)


def list_tree(root: str) -> int:
    """Stat every entry (what a training job's listing does): dentries and attributes cached."""
    count = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            os.stat(os.path.join(directory, name))
            count += 1
    return count


# --- readers ---------------------------------------------------------------------------------


def _read_fd(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while part := os.read(fd, 1 << 20):
            parts.append(part)
        return b"".join(parts)
    finally:
        os.close(fd)


def _check(path: str, data: bytes, size: int, sha256: str | None) -> str | None:
    if len(data) != size:
        return f"{path}: read {len(data)} bytes, expected {size}"
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return f"{path}: content differs from the source (sha256)"
    return None


def _check_large(path: str, size: int, chunk_digests: dict[int, int]) -> str | None:
    """Read a large file MiB by MiB into one reused buffer (no copy the path under test does
    not make), checking its length and the xxh3 of the MiBs named in ``chunk_digests``."""
    buffer = bytearray(_MIB)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = index = 0
        while True:
            got = 0
            while got < _MIB and (n := os.readv(fd, [view[got:]])):
                got += n
            if (
                index in chunk_digests
                and xxhash.xxh3_64_intdigest(view[:got]) != chunk_digests[index]
            ):
                return f"{path}: MiB {index} differs from the source (xxh3)"
            total += got
            index += 1
            if got < _MIB:
                break
    finally:
        os.close(fd)
    return None if total == size else f"{path}: read {total} bytes, expected {size}"


def _process_reader(paths, sizes, indices, sample, barrier, results) -> None:
    barrier.wait()
    error = None
    try:
        for index in indices:
            expected = sample.get(index)
            if isinstance(expected, dict):  # a large file: per-MiB digests
                error = _check_large(paths[index], sizes[index], expected)
            else:
                error = _check(paths[index], _read_fd(paths[index]), sizes[index], expected)
            if error:
                break
    except Exception as exc:  # reported by the parent, not lost in a child
        error = f"{type(exc).__name__}: {exc}"
    results.put(error)


def process_pass(
    paths: Sequence[str],
    sizes: Sequence[int],
    order: Sequence[int],
    readers: int,
    sample: dict[int, str] | dict[int, dict[int, int]],
) -> float:
    """Seconds for ``readers`` processes to read ``order`` (reader t takes order[t::readers]),
    from their release to the last one's end. Raises BenchmarkFailure on a wrong file."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(readers + 1)
    results = context.Queue()
    children = [
        context.Process(
            target=_process_reader,
            args=(paths, sizes, order[t::readers], sample, barrier, results),
        )
        for t in range(readers)
    ]
    for child in children:
        child.start()
    barrier.wait()
    began = time.perf_counter()
    errors = [results.get() for _ in children]
    seconds = time.perf_counter() - began
    for child in children:
        child.join()
    failed = [error for error in errors if error]
    if failed:
        raise BenchmarkFailure(f"{len(failed)} reader(s) failed; first: {failed[0]}")
    return seconds


def thread_pass(paths, sizes, order, readers, sample) -> float:
    return read_pass(paths, sizes, order, readers, sample, _read_fd).seconds


# --- the systems -----------------------------------------------------------------------------


class System:
    """One way of reaching the files: a tmpfs copy, or a cachefs worker's mount."""

    def __init__(self, name: str, root: str, worker: WorkerProcess | None = None):
        self.name = name
        self.root = root  # the directory holding SMALL and LARGE
        self.worker = worker

    def paths(self, dataset: str, relative: Sequence[str]) -> list[str]:
        return [os.path.join(self.root, dataset, path) for path in relative]

    def counters(self) -> dict[str, float]:
        if self.worker is None:
            return {}
        status = self.worker.client.status()
        counters = status["activity"]["counters"]
        native = status["fuse_fast_read"] or {}
        return {
            "worker_cpu_s": self.worker.cpu_seconds(),
            "python_reads": counters.get("python_reads", 0),
            "native_reads": counters.get("native_reads", 0),
            "misses": counters.get("misses", 0),
            # OPENs that handed a block file to the kernel (FUSE passthrough)
            "passthrough_opens": native.get("pt_opens", 0),
        }


def measure(
    system: System, run: Callable[[], float], prepare: Callable[[], None], repeats: int
) -> dict:
    """Best of ``repeats`` runs; with the worker's counters over the best one."""
    best = None
    for _ in range(repeats):
        prepare()
        before = system.counters()
        seconds = run()
        after = system.counters()
        delta = {key: after[key] - before[key] for key in after}
        if best is None or seconds < best[0]:
            best = (seconds, delta)
    seconds, delta = best
    return {"seconds": seconds, "worker": delta}


# --- the benchmark ---------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace) -> dict:
    with lock_workdir(args.workdir, "native_read_bench"):
        return _run(args)


def _make_large(
    root: str, count: int, mib: int
) -> tuple[list[str], list[int], dict[int, dict[int, int]]]:
    """The large files, and for each the xxh3 of every LARGE_CHECK_EVERY-th MiB."""
    os.makedirs(os.path.join(root, LARGE), exist_ok=True)
    planned = {f"shard-{i:03d}.bin" for i in range(count)}
    for stale in set(os.listdir(os.path.join(root, LARGE))) - planned:  # an earlier run's
        os.unlink(os.path.join(root, LARGE, stale))
    names, sizes, digests = [], [], {}
    for i in range(count):
        name = f"shard-{i:03d}.bin"
        path = os.path.join(root, LARGE, name)
        size = mib * _MIB
        rng = random.Random(f"{_LARGE_SEED}/{i}")
        exists = os.path.exists(path) and os.path.getsize(path) == size
        checked: dict[int, int] = {}
        with open(os.devnull if exists else path, "wb") as out:
            for k in range(mib):
                chunk = rng.randbytes(_MIB)
                out.write(chunk)
                if k % LARGE_CHECK_EVERY == 0:
                    checked[k] = xxhash.xxh3_64_intdigest(chunk)
        names.append(name)
        sizes.append(size)
        digests[i] = checked
    return names, sizes, digests


def _run(args: argparse.Namespace) -> dict:
    source = os.path.join(args.workdir, "source")
    plan = plan_dataset(args.files, classes=args.classes, seed=args.seed)
    print(
        f"generating {len(plan.files):,} files and {args.large_files} x {args.large_mib} MiB "
        f"in {source}",
        file=sys.stderr,
    )
    write_local(os.path.join(source, SMALL), plan, exact=True)
    if args.emulator:
        samples_plan = emulator.plan_samples(args.emulator, seed=args.seed)
        write_local(os.path.join(source, SAMPLES), samples_plan, exact=True)
    if args.walk:
        _make_namespace(os.path.join(source, NAMES), args.walk)
    large_names, large_sizes, large_digests = _make_large(source, args.large_files, args.large_mib)
    small_names = [spec.path for spec in plan.files]
    small_sizes = [spec.size for spec in plan.files]
    order = list(range(len(plan.files)))
    random.Random(args.seed + 1).shuffle(order)
    sample_ids = random.Random(args.seed + 2).sample(order, min(args.sample, len(order)))
    sample = {
        i: hashlib.sha256(file_bytes(plan.files[i], plan.seed)).hexdigest() for i in sample_ids
    }
    readers = sorted({int(n) for n in args.readers.split(",")})
    total = plan.total_bytes + sum(large_sizes) + (samples_plan.total_bytes if args.emulator else 0)
    ram = f"{(total * 5 // 4 >> 20) + 256}MiB"

    tmpfs_root = f"/dev/shm/cachefs-native-bench-{os.getpid()}"
    workers: list[WorkerProcess] = []
    results: dict = {
        "benchmark": "native_read_bench",
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "pipes": describe_pipes(),
        "kernel_hashes": describe_kernel_hashes(),
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "bench.native_read_bench", *sys.argv[1:]]
        ),
        "files": len(plan.files),
        "small_bytes": plan.total_bytes,
        "large_files": args.large_files,
        "large_mib": args.large_mib,
        "repeats": args.repeats,
        "back_pages": args.back_pages,
        "systems": args.systems.split(","),
        "passes": [],
    }
    try:
        shutil.rmtree(tmpfs_root, ignore_errors=True)
        shutil.copytree(source, tmpfs_root)
        systems = [System("tmpfs", tmpfs_root)]
        for name in args.systems.split(","):
            workdir = os.path.join(args.workdir, name)
            os.makedirs(workdir, exist_ok=True)
            worker = WorkerProcess(
                workdir,
                ram=ram,
                env={},
                ram_dir=f"/dev/shm/cachefs-native-bench-{name}",
                extra_args=WORKER_OPTIONS[name],
            )
            workers.append(worker)
            # --large-files 0 skips the large pass: no "large" dataset (an empty source is
            # refused by the worker)
            datasets = [SMALL] + [LARGE] * bool(large_names) + [SAMPLES] * bool(args.emulator)
            if len(systems) == 1:  # the walk: tmpfs and the first worker only
                datasets += [NAMES] * bool(args.walk)
            for dataset in datasets:
                worker.client.add_dataset(
                    {"name": dataset, "uri": f"file://{os.path.join(source, dataset)}"}
                )
            systems.append(System(name, worker.mount, worker))
            print(f"{name}: worker pid {worker.process.pid}, RAM tier {ram}", file=sys.stderr)
        results["passes"] = _passes(
            args,
            systems,
            readers,
            order,
            sample,
            (small_names, small_sizes),
            (large_names, large_sizes, large_digests),
        )
        results["native_counters"] = {
            s.name: s.worker.client.status()["fuse_fast_read"]
            for s in systems[1:]
            if s.name != "python"
        }
        results["rss_bytes"] = {s.name: s.worker.client.status()["rss_bytes"] for s in systems[1:]}
        # The serving processes of --fuse-processes: pids, deaths, requests forwarded by op.
        results["fuse_processes"] = {
            s.name: s.worker.client.status()["fuse_processes"] for s in systems[1:]
        }
    finally:
        for worker in workers:
            worker.stop()
        shutil.rmtree(tmpfs_root, ignore_errors=True)
    results["summary"] = summarise(results["passes"], readers)
    return results


def _passes(args, systems, readers, order, sample, small, large) -> list[dict]:
    small_names, small_sizes = small
    large_names, large_sizes, large_digests = large
    passes = []

    def record(name: str, system: System, n: int, files: int, nbytes: int, result: dict) -> None:
        seconds = result["seconds"]
        row = {
            "pass": name,
            "system": system.name,
            "readers": n,
            "files": files,
            "seconds": round(seconds, 4),
            "files_per_s": round(files / seconds, 1),
            "mb_per_s": round(nbytes / seconds / 1e6, 1),
            "worker": result["worker"],
        }
        cpu = result["worker"].get("worker_cpu_s")
        if cpu is not None:
            row["worker_cpu_ms_per_1000_files"] = round(cpu * 1000 / files * 1000, 1)
        passes.append(row)
        print(
            f"  {name:<24} {system.name:<7} {n:>2} readers: {row['files_per_s']:>9,.0f} "
            f"files/s {row['mb_per_s']:>8,.0f} MB/s  {result['worker']}",
            file=sys.stderr,
        )

    for system in systems:  # fill the RAM tiers (and check every file once)
        paths = system.paths(SMALL, small_names)
        process_pass(paths, small_sizes, order, 8, sample)
        if large_names:
            large_paths = system.paths(LARGE, large_names)
            process_pass(large_paths, large_sizes, list(range(len(large_paths))), 1, large_digests)
    for system in systems[1:]:
        for dataset in [SMALL] + [LARGE] * bool(large_names):
            cached = next(d for d in system.worker.client.datasets() if d["name"] == dataset)
            if cached["cached_fraction"] < 1.0:
                raise BenchmarkFailure(
                    f"{system.name}: {dataset} only {cached['cached_fraction']:.0%} in the RAM tier"
                )
    nbytes = sum(small_sizes)
    files = len(order)
    for n in readers:
        for system in systems:
            paths = system.paths(SMALL, small_names)
            root = os.path.join(system.root, SMALL)

            def after_listing(level: int = 1, root: str = root) -> None:
                list_tree(root)
                drop_caches(level, nbytes if args.back_pages else 0)

            for name, runner, prepare in (
                ("first_read_ram", process_pass, after_listing),
                ("first_read_ram_threads", thread_pass, after_listing),
                ("first_read_ram_echo3", process_pass, lambda r=root: after_listing(3, r)),
            ):
                if name == "first_read_ram_echo3" and n != max(readers):
                    continue
                result = measure(
                    system,
                    lambda r=runner, p=paths, k=n: r(p, small_sizes, order, k, sample),
                    prepare,
                    args.repeats,
                )
                record(name, system, n, files, nbytes, result)
    n_warm = 4 if 4 in readers else max(readers)
    for system in systems:
        paths = system.paths(SMALL, small_names)
        result = measure(
            system,
            lambda p=paths: process_pass(p, small_sizes, order, n_warm, sample),
            lambda p=paths: process_pass(p, small_sizes, order, 8, {}),
            args.repeats,
        )
        record("warm", system, n_warm, files, nbytes, result)
    for system in systems if large_names else ():
        paths = system.paths(LARGE, large_names)
        large_order = list(range(len(paths)))
        result = measure(
            system,
            lambda p=paths, o=large_order: process_pass(p, large_sizes, o, 1, large_digests),
            lambda: drop_caches(1, sum(large_sizes) if args.back_pages else 0),
            args.repeats,
        )
        record("large_first_read_ram", system, 1, len(paths), sum(large_sizes), result)
    for command in (["ls", "-lR"], ["find"]):
        for system in systems:
            root = os.path.join(system.root, SMALL)

            def run_tool(c=command, r=root) -> float:
                began = time.perf_counter()
                subprocess.run([*c, r], stdout=subprocess.DEVNULL, check=True)
                return time.perf_counter() - began

            run_tool()  # warm: the timed runs find everything cached
            result = measure(system, run_tool, lambda: None, args.repeats)
            record("ls_lR" if command[0] == "ls" else "find", system, 1, files, 0, result)
    subset = order[: max(1, len(order) // args.cold_fraction)]
    for system in systems:
        paths = system.paths(SMALL, small_names)

        def fresh(s=system) -> None:
            if s.worker is not None:
                s.worker.client.remove_dataset(SMALL)
                s.worker.client.add_dataset(
                    {"name": SMALL, "uri": f"file://{os.path.join(args.workdir, 'source', SMALL)}"}
                )
            drop_caches(3)

        result = measure(
            system,
            lambda p=paths: process_pass(p, small_sizes, subset, max(readers), sample),
            fresh,
            args.repeats,
        )
        record(
            "first_read_source",
            system,
            max(readers),
            len(subset),
            sum(small_sizes[i] for i in subset),
            result,
        )
    if args.walk:
        passes += _walk_passes(args, systems)
    if args.emulator:
        passes += _emulator_passes(args, systems)
    return passes


def _make_namespace(root: str, entries: int) -> None:
    """The metadata workload's namespace of empty files (kept between runs once complete)."""
    done = f"{root}.complete-{entries}"
    if os.path.exists(done):
        return
    shutil.rmtree(root, ignore_errors=True)
    made = set()
    for key in metadata.namespace_keys(entries):
        path = os.path.join(root, key)
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        open(path, "wb").close()
    open(done, "wb").close()


def _walk_passes(args, systems) -> list[dict]:
    """Two cold walks of the namespace (tmpfs and the first worker): the first after the
    add, then a second one; each after ``echo 3``, every count checked."""
    files, dirs = metadata.expected_counts(args.walk)
    rows = []
    for system in systems[:2]:
        root = os.path.join(system.root, NAMES)
        if system.worker is not None:
            # tmpfs never drops its dentries, so its copy of the namespace would stay in the
            # kernel's dentry hash table while the worker's is walked, lengthening every chain
            # that walk searches (2.6 M dentries instead of 1.3 M at 1.28 M entries). Each
            # system walks with only its own tree cached; the row says how many dentries were.
            shutil.rmtree(os.path.join(systems[0].root, NAMES))
        tmpfs_copy_present = os.path.exists(os.path.join(systems[0].root, NAMES))
        for name in ("walk_cold_first", "walk_cold_second"):
            drop_caches(3)
            cached_dentries = kernel_dentries()
            before = system.counters()
            counts, _ = metadata.walk(root)
            after = system.counters()
            if (counts["files"], counts["dirs"]) != (files, dirs):
                raise BenchmarkFailure(f"{name} of {root} saw {counts}; expected {files}, {dirs}")
            worker = {key: after[key] - before[key] for key in after}
            row = {
                "pass": name, "system": system.name, "readers": 1, "files": counts["entries"],
                "seconds": round(counts["seconds"], 4),
                "entries_per_s": round(counts["entries_per_s"], 1), "worker": worker,
                "dentries_before": cached_dentries, "tmpfs_copy_present": tmpfs_copy_present,
            }  # fmt: skip
            if "worker_cpu_s" in worker:
                row["worker_cpu_us_per_entry"] = round(
                    worker["worker_cpu_s"] * 1e6 / counts["entries"], 2
                )
            print(f"  {name:<24} {system.name:<7} {row['entries_per_s']:>11,.0f} entries/s",
                  file=sys.stderr)  # fmt: skip
            rows.append(row)
        if system.worker is not None:
            pid = system.worker.client.status()["pid"]
            rows[-1]["worker_rss"] = metadata.process_rss(pid)
    return rows


def _emulator_passes(args, systems) -> list[dict]:
    """The emulator's search on tmpfs and every worker, page cache dropped (after a listing)
    before each trial; each worker's RAM tier is filled by one read first."""
    rows = []
    for system in systems:
        data = f"dir:{os.path.join(system.root, SAMPLES)}"
        if system.worker is not None:
            emulator.warm_up(emulator.parse_data_path(data), _emulator_samples(args))
        argv = [
            "--data", data, "--samples", str(args.emulator), "--seed", str(args.seed),
            "--scale", str(args.emulator_scale), "--batches", "20",
            "--max-accelerators", "32", "--drop-pages",
        ]  # fmt: skip
        options = emulator.build_parser().parse_args(argv)
        options.argv = argv
        before = system.counters()
        result = emulator.run_benchmark(options)
        after = system.counters()
        largest = result["search"]["largest_accelerators"]
        print(
            f"  emulator_drop_pages      {system.name:<7} {largest} accelerators", file=sys.stderr
        )
        rows.append({
            "pass": "emulator_drop_pages",
            "system": system.name,
            "readers": 0,
            "accelerators": largest,
            "trials": result["trials"],
            "worker": {key: after[key] - before[key] for key in after},
        })  # fmt: skip
    return rows


def _emulator_samples(args) -> emulator.Samples:
    return emulator.Samples.of(emulator.plan_samples(args.emulator, seed=args.seed))


def summarise(passes: list[dict], readers: Sequence[int]) -> list[dict]:
    """Per pass and reader count: each system's rate and its ratio to tmpfs."""
    rows = []
    keys = sorted({(p["pass"], p["readers"]) for p in passes}, key=lambda k: (k[0], k[1]))
    for name, n in keys:
        by_system = {p["system"]: p for p in passes if p["pass"] == name and p["readers"] == n}
        tmpfs = by_system.get("tmpfs")
        row = {"pass": name, "readers": n}
        if name.startswith("walk_cold"):
            for system, p in by_system.items():
                row[f"{system}_entries_per_s"] = p["entries_per_s"]
                if tmpfs and system != "tmpfs":
                    row[f"{system}_ratio"] = round(p["entries_per_s"] / tmpfs["entries_per_s"], 3)
                if "worker_cpu_us_per_entry" in p:
                    row[f"{system}_cpu_us_per_entry"] = p["worker_cpu_us_per_entry"]
                if "worker_rss" in p:
                    row[f"{system}_rss"] = p["worker_rss"]
                if "dentries_before" in p:
                    row[f"{system}_dentries_before"] = p["dentries_before"]
            rows.append(row)
            continue
        if name == "emulator_drop_pages":
            for system, p in by_system.items():
                row[f"{system}_accelerators"] = p["accelerators"]
                if tmpfs and system != "tmpfs" and tmpfs["accelerators"]:
                    row[f"{system}_ratio"] = round(p["accelerators"] / tmpfs["accelerators"], 3)
            rows.append(row)
            continue
        for system, p in by_system.items():
            if name in ("ls_lR", "find"):
                row[f"{system}_s"] = p["seconds"]
                if tmpfs and system != "tmpfs":
                    row[f"{system}_x_tmpfs_time"] = round(p["seconds"] / tmpfs["seconds"], 2)
                continue
            unit = "mb_per_s" if name.startswith("large") else "files_per_s"
            row[f"{system}_{unit}"] = p[unit]
            if tmpfs and system != "tmpfs":
                row[f"{system}_ratio"] = round(p[unit] / tmpfs[unit], 3)
            if "worker_cpu_ms_per_1000_files" in p:
                row[f"{system}_cpu_ms_per_1000"] = p["worker_cpu_ms_per_1000_files"]
        rows.append(row)
    return rows


def kernel_dentries() -> int:
    """Dentries in the kernel's cache now (/proc/sys/fs/dentry-state, first field)."""
    with open("/proc/sys/fs/dentry-state") as f:
        return int(f.read().split()[0])


def describe_kernel_hashes() -> dict:
    """The sizes of the kernel's dentry and inode hash tables when the boot command line sets
    them (``dhash_entries=``, ``ihash_entries=``; otherwise the kernel sizes them from memory).
    A cold walk of N entries through FUSE inserts N dentries and N inodes, and every insert
    first searches a chain of (cached entries / table size): with 131,072 and 65,536 buckets a
    1.28 M-entry walk searches chains of ~10 and ~20 entries per file, which tmpfs (its inodes
    are not hashed, its dentries already exist) never does."""
    with open("/proc/cmdline") as f:
        words = f.read().split()
    found = {}
    for word in words:
        key, _, value = word.partition("=")
        if key in ("dhash_entries", "ihash_entries") and value.isdigit():
            found[key] = int(value)
    return found


def describe_pipes() -> dict:
    """What bounds the READs the passthrough system splices (cachefs_fast_read.c, "splicing"):
    a pipe may grow past fs.pipe-max-size only with CAP_SYS_RESOURCE."""
    with open("/proc/sys/fs/pipe-max-size") as f:
        max_size = int(f.read())
    with open("/proc/self/status") as f:
        effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    cap_sys_resource = 24
    return {"pipe_max_size": max_size, "cap_sys_resource": bool(effective >> cap_sys_resource & 1)}


def render(results: dict) -> str:
    machine = results["machine"]
    names = results["systems"]
    first = names[0]
    lines = [
        f"# Native READ path vs Python vs tmpfs — {results['date']}",
        "",
        f"Machine: {machine['nproc']} cores ({machine['cpu']}), "
        f"{machine['memory_bytes'] / 2**30:.0f} GiB, kernel {machine['kernel']}, "
        f"Python {machine['python']}.",
        f"Command: `{results['command']}`",
        f"Pipes: fs.pipe-max-size {results['pipes']['pipe_max_size']:,} bytes, "
        f"CAP_SYS_RESOURCE {'yes' if results['pipes']['cap_sys_resource'] else 'no'} (the "
        "largest READ passthrough splices: 2 MiB pipes with the capability, else that size).",
        "Kernel hash tables: "
        + (
            ", ".join(f"{k}={v:,}" for k, v in results.get("kernel_hashes", {}).items())
            or "sized by the kernel from memory"
        )
        + " (a cold walk's dentry and inode inserts search these; see `describe_kernel_hashes`).",
        f"Data: {results['files']:,} small files ({results['small_bytes'] / 1e6:,.0f} MB), "
        f"{results['large_files']} x {results['large_mib']} MiB large files; best of "
        f"{results['repeats']}; "
        + (
            "pages backed before the RAM-tier first-read passes (`--back-pages`)."
            if results.get("back_pages")
            else "pages as the kernel hands them out (`--no-back-pages`)."
        ),
        "",
        "| pass | readers | tmpfs | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n}/tmpfs" for n in names)
        + " | "
        + " | ".join(f"{n} CPU ms/1000 files" for n in names)
        + " |",
        "|---|---|---|" + "---|" * (3 * len(names)),
    ]
    rss_lines: list[str] = []
    for row in results["summary"]:
        if row["pass"].startswith("walk_cold"):
            lines.append(
                f"| {row['pass']} (entries/s) | 1 | {row.get('tmpfs_entries_per_s', '')} | "
                f"{row.get(f'{first}_entries_per_s', '')} |{' |' * (len(names) - 1)} "
                f"{row.get(f'{first}_ratio', '')} |{' |' * (len(names) - 1)} "
                f"{row.get(f'{first}_cpu_us_per_entry', '')} us/entry |{' |' * (len(names) - 1)}"
            )
            rss_lines.append(
                f"{row['pass']}: dentries cached before the walk: tmpfs "
                f"{row.get('tmpfs_dentries_before', '?'):,}, {first} "
                f"{row.get(f'{first}_dentries_before', '?'):,}."
            )
            if f"{first}_rss" in row:
                rss = row[f"{first}_rss"]
                rss_lines.append(
                    f"{first} worker after the walks: VmRSS {rss['VmRSS'] >> 20} MiB "
                    f"(anonymous {rss['RssAnon'] >> 20} MiB, file-backed "
                    f"{rss['RssFile'] >> 20} MiB: libraries and snapshot pages), peak "
                    f"{rss['VmHWM'] >> 20} MiB."
                )
            continue
        if row["pass"] == "emulator_drop_pages":
            lines.append(
                f"| emulator, page cache dropped (accelerators >= 90 % busy) | | "
                f"{row.get('tmpfs_accelerators', '')} | "
                + " | ".join(str(row.get(f"{n}_accelerators", "")) for n in names)
                + " | "
                + " | ".join(str(row.get(f"{n}_ratio", "")) for n in names)
                + " |"
                + " |" * len(names)
            )
            continue
        if row["pass"] in ("ls_lR", "find"):
            lines.append(
                f"| {row['pass']} (s, warm) | 1 | {row.get('tmpfs_s', '')} | "
                + " | ".join(str(row.get(f"{n}_s", "")) for n in names)
                + " | "
                + " | ".join(f"{row.get(f'{n}_x_tmpfs_time', '')}x time" for n in names)
                + " |"
                + " |" * len(names)
            )
            continue
        unit = "mb_per_s" if row["pass"].startswith("large") else "files_per_s"
        label = "MB/s" if unit == "mb_per_s" else "files/s"
        lines.append(
            f"| {row['pass']} ({label}) | {row['readers']} | {row.get(f'tmpfs_{unit}', '')} | "
            + " | ".join(str(row.get(f"{n}_{unit}", "")) for n in names)
            + " | "
            + " | ".join(str(row.get(f"{n}_ratio", "")) for n in names)
            + " | "
            + " | ".join(str(row.get(f"{n}_cpu_ms_per_1000", "")) for n in names)
            + " |"
        )
    lines += [
        "",
        f"Worker RSS at the end: {results.get('rss_bytes')}. Native path counters: "
        f"{results.get('native_counters')}. Serving processes: "
        f"{results.get('fuse_processes')}.",
        *rss_lines,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", type=int, default=500, help="files checked by sha256")
    parser.add_argument("--readers", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--large-files",
        type=int,
        default=4,
        help="large files for large_first_read_ram (0: skip it)",
    )
    parser.add_argument("--large-mib", type=int, default=256)
    parser.add_argument(
        "--back-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the drop_caches of the RAM-tier first-read passes, take and give back 1.25x "
        "their bytes of memory, so that their page cache lands on pages the VM's host backs "
        "(bench/page_cost.py)",
    )
    parser.add_argument(
        "--cold-fraction",
        type=int,
        default=10,
        help="first_read_source reads 1/N of the files (the source is the slow part)",
    )
    parser.add_argument(
        "--emulator",
        type=int,
        default=0,
        metavar="SAMPLES",
        help="also run the training-input emulator on this many samples (0: not)",
    )
    parser.add_argument("--emulator-scale", type=float, default=0.1, help="its --scale")
    parser.add_argument(
        "--walk",
        type=int,
        default=0,
        metavar="ENTRIES",
        help="also walk an ImageNet-shaped namespace of this many empty files (0: not)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(WORKER_OPTIONS),
        help=f"the cachefs workers to compare with tmpfs, in order ({', '.join(WORKER_OPTIONS)})",
    )
    parser.add_argument("--workdir", default="/tmp/cachefs-native-bench")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    parser.add_argument("--save-dir", help="write <dir>/<date>.json and .md")
    args = parser.parse_args(argv)
    if args.large_files < 0 or args.large_mib < 1:
        parser.error("--large-files must be >= 0 and --large-mib >= 1")
    os.makedirs(args.workdir, exist_ok=True)
    return run_and_report("native_read_bench", args, run_benchmark, render)


if __name__ == "__main__":
    sys.exit(main())
