"""Single-node read benchmark: files/s and GB/s through a cachefs mount, against tmpfs, in one run.

    python -m bench.read_bench [--files N] [--threads 1,4] [--source s3|file] [--json out.json]

Passes, each with every reader count of ``--threads``, over one ImageNet-like tree
(bench/datagen.py) in one shuffled order (fixed seed); every file is opened, read fully, closed:

1. ``tmpfs_direct``: the tree copied to /dev/shm and read with plain open/read — the limit.
2. ``backend_raw_get``: the source's own capacity at the same concurrency — boto3 GETs of whole
   objects against the moto server (``--source s3``), or plain reads of the source directory with
   the page cache dropped (``--source file``).
3. ``cachefs_first_read_store``: a cachefs mount with nothing cached (dataset freshly added,
   page cache dropped): every file is fetched from the source through the worker.
4. ``cachefs_first_read_ram``: the worker's RAM tier holds every block; the kernel page cache
   (and dentry cache) is dropped before the pass, so every open/read reaches the worker.
5. ``cachefs_warm``: everything read once right before the run, so the kernel page cache holds
   the data (``keep_cache``): only open/release reach the worker.

Every pass checks the length of every file and the sha256 of a fixed sample of files against the
generator: a wrong length, or a wrong byte in a sampled file, fails the benchmark. Each pass runs
``--repeats`` times and the best run is kept (the machine is shared). Output: JSON (stdout or
``--json``) and a markdown table; ``--save-dir`` writes both as ``<dir>/<YYYY-MM-DD>.json|md``.
``--profile PASS[,PASS]`` adds one extra, untimed run of each named cachefs pass at the largest
reader count under ``py-spy record`` and summarises where the worker's FUSE loop spends its time.

Needs root (drop_caches, FUSE mounts). Nothing here is imported by cachefs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from bench.datagen import (
    DatasetPlan,
    file_bytes,
    plan_dataset,
    size_summary,
    upload_s3,
    write_local,
)
from cachefs.pidlock import LockHeld, take_pid_lock
from harness import processes
from harness.processes import drop_page_cache as drop_page_cache  # the benches import it here
from harness.processes import free_port as free_port

DATASET_NAME = "imagenet"
BUCKET = "cachefs-read-bench"
#: Credentials the bench gives moto and the worker; moto accepts any, these stay on loopback.
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "cachefs-bench-access-key",
    "AWS_SECRET_ACCESS_KEY": "cachefs-bench-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

PASS_TITLES = {
    "tmpfs_direct": "tmpfs direct (the limit)",
    "backend_raw_get": "backend raw GET (no FUSE)",
    "cachefs_first_read_store": "cachefs first read, from the store",
    "cachefs_first_read_ram": "cachefs first read, from the RAM tier (page cache dropped)",
    "cachefs_warm": "cachefs warm (page cache holds the data)",
}

#: Files/s of other systems measured earlier on this machine type (2 cores, 10,000 files of
#: 110 KB, S3 served by s3rver on loopback) — NOT re-measured by this benchmark
#: (the suite, python -m bench, measures s3fs and rclone side by side).
REFERENCE_FILES_PER_S = {
    "s3fs 1.90": {"first_read": 357, "warm@1": 559, "warm@4": 1295},
    "rclone 1.60 (vfs-cache full)": {"first_read": 274, "warm@1": 934, "warm@4": 1540},
    "minimal pyfuse3 passthrough": {"first_read": 2600, "warm@1": 8300, "warm@4": 14000},
    "tmpfs direct": {"warm@1": 33000, "warm@4": 22000},
}
#: The systems the "≥ 5x" targets are judged against.
PEERS = ("s3fs 1.90", "rclone 1.60 (vfs-cache full)")
TARGET_READERS = 4
WARM_VS_TMPFS_TARGET = 0.7
RAM_FIRST_READ_TARGET_FILES_PER_S = 6000
PEER_FACTOR_TARGET = 5.0


class BenchmarkFailure(Exception):
    """The benchmark could not produce a trustworthy number (wrong bytes, a dead worker...)."""


# --- reading --------------------------------------------------------------------------------


@dataclass
class ReadRun:
    seconds: float
    files: int
    bytes: int
    #: Share of the machine's CPU busy just before the run (other work on the shared machine).
    cpu_busy_before: float | None = None


T = TypeVar("T")


def run_together(work: Callable[[T], None], parts: Sequence[T]) -> float:
    """Run ``work(part)`` for every part, each in its own thread, all released at once; returns
    the seconds from their release to the last one's end (thread start-up is not timed)."""
    start = threading.Barrier(len(parts) + 1)

    def run(part: T) -> None:
        start.wait()
        work(part)

    threads = [threading.Thread(target=run, args=(part,), daemon=True) for part in parts]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began


def read_pass(
    paths: Sequence[str],
    sizes: Sequence[int],
    order: Sequence[int],
    threads: int,
    sample_sha256: dict[int, str],
    read_file: Callable[[str], bytes] | None = None,
) -> ReadRun:
    """Read ``paths[i]`` for every ``i`` in ``order`` with ``threads`` readers; verify every
    length against ``sizes`` and the sha256 of every index in ``sample_sha256``.

    Reader ``t`` takes ``order[t::threads]`` (no shared queue: its cost would show in the tmpfs
    numbers). The clock runs from the moment all readers are released to the last one's end.
    Raises BenchmarkFailure naming the first file that came back wrong.
    """
    read_file = read_file or read_whole_file
    errors: list[str] = []

    def reader(indices: Sequence[int]) -> None:
        try:
            for index in indices:
                data = read_file(paths[index])
                if len(data) != sizes[index]:
                    errors.append(
                        f"{paths[index]}: read {len(data)} bytes, expected {sizes[index]}"
                    )
                    return
                expected = sample_sha256.get(index)
                if expected is not None and hashlib.sha256(data).hexdigest() != expected:
                    errors.append(f"{paths[index]}: content differs from the source (sha256)")
                    return
        except Exception as exc:  # reported with the pass, not lost in a thread
            errors.append(f"{type(exc).__name__}: {exc}")

    seconds = run_together(reader, [order[t::threads] for t in range(threads)])
    if errors:
        raise BenchmarkFailure(f"{len(errors)} reader(s) failed; first: {errors[0]}")
    return ReadRun(seconds, len(order), sum(sizes[i] for i in order))


def read_whole_file(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Share of all CPUs busy (not idle, not iowait) over ``interval`` seconds, from /proc/stat."""

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)

    idle_before, total_before = snapshot()
    time.sleep(interval)
    idle_after, total_after = snapshot()
    return 1 - (idle_after - idle_before) / max(1, total_after - total_before)


def wait_for_quiet_cpu(threshold: float, max_wait_s: float) -> float:
    """Wait (at most ``max_wait_s``) until at most ``threshold`` of the CPU is busy, so that a
    run does not start in the middle of someone else's burst; return the last busy share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = cpu_busy_fraction()
        if busy <= threshold or time.monotonic() >= deadline:
            return busy


# --- results --------------------------------------------------------------------------------


@dataclass
class PassResult:
    """The best of several runs of one pass at one reader count."""

    name: str
    threads: int
    files: int
    bytes: int
    seconds: float
    all_seconds: list[float]
    files_per_s: float
    gb_per_s: float
    #: What the worker counted during the best run (hits, misses, store GETs): evidence that
    #: the pass measured what its name says.
    worker_delta: dict[str, int] = field(default_factory=dict)
    #: Per run, the share of the machine's CPU that was busy just before it started.
    cpu_busy_before: list[float | None] = field(default_factory=list)

    @classmethod
    def best_of(cls, name: str, threads: int, runs: list[tuple[ReadRun, dict]]) -> PassResult:
        best, delta = min(runs, key=lambda run: run[0].seconds)
        return cls(
            name=name,
            threads=threads,
            files=best.files,
            bytes=best.bytes,
            seconds=best.seconds,
            all_seconds=[round(run.seconds, 4) for run, _ in runs],
            files_per_s=best.files / best.seconds,
            gb_per_s=best.bytes / best.seconds / 1e9,
            worker_delta=delta,
            cpu_busy_before=[run.cpu_busy_before for run, _ in runs],
        )


def find_pass(passes: Sequence[dict], name: str, threads: int) -> dict | None:
    return next((p for p in passes if p["name"] == name and p["threads"] == threads), None)


def evaluate(passes: Sequence[dict], *, s3_source: bool = True) -> tuple[list[dict], list[dict]]:
    """Ratios and pass/fail targets from the pass results (dicts as in the JSON).

    Returns (ratios, targets); a ratio or target whose passes are missing is left out. The
    peers' first-read numbers were measured against an S3 server, so a first read from a local
    directory (``s3_source=False``) is not compared with them.
    """
    ratios: list[dict] = []
    tmpfs = {p["threads"]: p["files_per_s"] for p in passes if p["name"] == "tmpfs_direct"}
    for p in passes:
        if p["name"].startswith("cachefs_") and p["threads"] in tmpfs:
            ratios.append(
                {
                    "what": f"{p['name']} / tmpfs_direct",
                    "threads": p["threads"],
                    "ratio": p["files_per_s"] / tmpfs[p["threads"]],
                }
            )
    for p in passes:
        if not p["name"].startswith("cachefs_"):
            continue
        if p["name"] == "cachefs_first_read_store" and not s3_source:
            continue
        column = _reference_column(p["name"], p["threads"])
        for system in PEERS:
            reference = REFERENCE_FILES_PER_S[system].get(column)
            if reference:
                ratios.append(
                    {
                        "what": f"{p['name']} / {system} {column} (reference)",
                        "threads": p["threads"],
                        "ratio": p["files_per_s"] / reference,
                    }
                )
    return ratios, _targets(passes)


def sanity_notes(passes: Sequence[dict]) -> list[str]:
    """Warnings when a cachefs pass's worker counters contradict what the pass claims to
    measure (e.g. a "warm" pass whose reads still reached the worker)."""
    notes = []
    for p in passes:
        delta, files, label = p.get("worker_delta") or {}, p["files"], f"{p['name']}@{p['threads']}"
        reads = sum(v for k, v in delta.items() if k.startswith("hits_")) + delta.get("misses", 0)
        if p["name"] == "cachefs_warm" and reads > 0.05 * files:
            notes.append(
                f"{label}: {reads:,} block reads reached the worker for {files:,} files: the page "
                "cache did not hold all the data (reclaimed or dropped by other work)"
            )
        if p["name"] == "cachefs_first_read_ram" and (
            delta.get("misses", 0) or delta.get("hits_ram", 0) < files
        ):
            notes.append(
                f"{label}: {delta.get('misses', 0):,} misses and {delta.get('hits_ram', 0):,} RAM "
                f"hits for {files:,} files: not every file was read from the RAM tier"
            )
        if p["name"] == "cachefs_first_read_store" and delta.get("store_gets", 0) < files:
            notes.append(
                f"{label}: only {delta.get('store_gets', 0):,} store GETs for {files:,} files: "
                "part of the data was already cached"
            )
    return notes


def _reference_column(pass_name: str, threads: int) -> str:
    """Which reference column a cachefs pass is compared with. A RAM-tier first read is
    compared with the peers' *warm* numbers (their best case: data in their cache and in the
    page cache), since the references have no "cached, page cache dropped" column."""
    if pass_name == "cachefs_first_read_store":
        return "first_read"
    return f"warm@{threads}"


def _targets(passes: Sequence[dict]) -> list[dict]:
    targets: list[dict] = []
    readers = TARGET_READERS
    warm = find_pass(passes, "cachefs_warm", readers)
    ram = find_pass(passes, "cachefs_first_read_ram", readers)
    tmpfs = find_pass(passes, "tmpfs_direct", readers)
    best_peer = max(REFERENCE_FILES_PER_S[s][f"warm@{readers}"] for s in PEERS)

    def add(description: str, value: float, threshold: float, unit: str) -> None:
        targets.append(
            {
                "target": description,
                "value": value,
                "threshold": threshold,
                "unit": unit,
                "met": value >= threshold,
            }
        )

    if warm and tmpfs:
        add(
            f"warm >= {WARM_VS_TMPFS_TARGET}x tmpfs direct, {readers} readers",
            warm["files_per_s"] / tmpfs["files_per_s"],
            WARM_VS_TMPFS_TARGET,
            "x tmpfs",
        )
    if ram:
        add(
            f"first read from RAM tier >= {RAM_FIRST_READ_TARGET_FILES_PER_S:,} files/s, "
            f"{readers} readers",
            ram["files_per_s"],
            RAM_FIRST_READ_TARGET_FILES_PER_S,
            "files/s",
        )
    for p, label in ((warm, "warm"), (ram, "first read from RAM tier")):
        if p:
            add(
                f"{label} >= {PEER_FACTOR_TARGET:g}x s3fs and rclone (their warm, {readers} "
                f"readers, reference)",
                p["files_per_s"] / best_peer,
                PEER_FACTOR_TARGET,
                "x best peer",
            )
    return targets


def render_markdown(results: dict) -> str:
    """The human report: setup, one row per pass, ratios, targets, references."""
    dataset, machine = results["dataset"], results["machine"]
    lines = [
        f"## cachefs single-node read benchmark — {results['date']}",
        "",
        f"- machine: {machine['nproc']} cores, {machine['memory_bytes'] / 2**30:.1f} GiB RAM, "
        f"kernel {machine['kernel']}, Python {machine['python']}",
        f"- load average (1/5/15 min) before: {_load(results['load_before'])}, "
        f"after: {_load(results['load_after'])} (machine shared with other work)",
        f"- dataset: {dataset['files']:,} files in {dataset['classes']} class dirs, "
        f"{dataset['bytes'] / 1e9:.2f} GB, mean {dataset['mean_size'] / 1e3:.0f} KB, "
        f"median {dataset['median_size'] / 1e3:.0f} KB (seed {dataset['seed']})",
        f"- source: {results['source']}",
        f"- worker: `cachefs up` defaults{_extra_args(results.get('worker_args'))}; "
        f"FUSE no-open mode: {_on_off(results.get('worker_fuse_no_open'))}",
        f"- best of {results['repeats']} runs per row; shuffled order (seed "
        f"{results['order_seed']}); every length and {results['sample_files']} sha256 samples "
        "verified per run",
        f"- worker RSS after the passes: {_rss(results.get('worker_rss_bytes'))}",
        "",
        "| pass | readers | files/s | GB/s | vs tmpfs | all runs: s (CPU busy before) "
        "| worker CPU/file | worker writes/file | reached the worker |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    tmpfs = {
        p["threads"]: p["files_per_s"] for p in results["passes"] if p["name"] == "tmpfs_direct"
    }
    for p in results["passes"]:
        versus = (
            f"{p['files_per_s'] / tmpfs[p['threads']]:.2f}x"
            if p["name"].startswith("cachefs_") and p["threads"] in tmpfs
            else ""
        )
        busy = p.get("cpu_busy_before") or [None] * len(p["all_seconds"])
        runs = ", ".join(
            f"{s:.2f}" + ("" if b is None else f" ({b:.0%})")
            for s, b in zip(p["all_seconds"], busy, strict=True)
        )
        delta = dict(p.get("worker_delta") or {})
        cpu_ms = delta.pop("worker_cpu_ms", None)
        cpu = "" if cpu_ms is None else f"{1000 * cpu_ms / p['files']:,.0f} µs"
        writes = delta.pop("worker_write_syscalls", None)
        writes = "" if writes is None else f"{writes / p['files']:.1f}"
        lines.append(
            f"| {PASS_TITLES.get(p['name'], p['name'])} | {p['threads']} "
            f"| {p['files_per_s']:,.0f} | {p['gb_per_s']:.3f} | {versus} | {runs} | {cpu} "
            f"| {writes} | {_delta(delta)} |"
        )
    lines += ["", "### Targets (reported, never asserted)", ""]
    lines += ["| target | value | threshold | met |", "|---|---:|---:|---|"]
    for t in results["targets"]:
        lines.append(
            f"| {t['target']} | {_target_number(t['value'], t['unit'])} {t['unit']} "
            f"| {_target_number(t['threshold'], t['unit'])} | {'PASS' if t['met'] else 'FAIL'} |"
        )
    lines += ["", "### Ratios", "", "| ratio | readers | value |", "|---|---:|---:|"]
    for r in results["ratios"]:
        lines.append(f"| {r['what']} | {r['threads']} | {r['ratio']:.2f}x |")
    lines += [
        "",
        "Reference numbers measured earlier on this machine type (2 cores, 10,000 files of "
        "110 KB, S3 served by s3rver on loopback), files/s. They were NOT re-measured in this "
        "run: the suite (python -m bench) measures s3fs and rclone side by side. Their "
        "first-read column measures their backend (~270-380 GET/s), not the FUSE layer.",
        "",
        "| system | first read | warm, 1 reader | warm, 4 readers |",
        "|---|---:|---:|---:|",
    ]
    for system, numbers in REFERENCE_FILES_PER_S.items():
        cells = [_number(numbers.get(k)) for k in ("first_read", "warm@1", "warm@4")]
        lines.append(f"| {system} | {' | '.join(cells)} |")
    for name, profile in (results.get("profiles") or {}).items():
        lines += _render_profile(name, profile)
    if results.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def _render_profile(name: str, profile: dict) -> list[str]:
    busy, idle = profile["fuse_loop_busy_samples"], profile["idle_samples"]
    lines = [
        "",
        f"### Profile: {PASS_TITLES.get(name, name)}, {profile['threads']} readers "
        f"(py-spy, an extra untimed run: {profile['files_per_s_under_profiler']:,.0f} files/s "
        "under the profiler)",
        "",
        f"{profile['samples']:,} samples: FUSE loop thread busy {busy:,}, idle (all threads) "
        f"{idle:,}, helper threads busy {profile['helper_thread_samples']:,}. "
        "Shares below are of the FUSE loop thread's busy samples.",
        "",
        "| where | share |",
        "|---|---:|",
    ]
    for layer, share in profile["fuse_loop_by_layer"].items():
        lines.append(f"| {layer} | {share:.0%} |")
    for handler, share in profile["fuse_loop_by_handler_inclusive"].items():
        lines.append(f"| of which inside {handler} | {share:.0%} |")
    return lines


def _on_off(flag: bool | None) -> str:
    return {True: "on", False: "off"}.get(flag, "not reported")


def _extra_args(worker_args: str | None) -> str:
    return f" plus `{worker_args}`" if worker_args else ""


def _target_number(value: float, unit: str) -> str:
    """Ratios with three decimals, so that 0.699 against a 0.7 threshold does not read 0.70."""
    return f"{value:.3f}" if unit.startswith("x") else _number(value)


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _load(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def _rss(rss: int | None) -> str:
    return "—" if rss is None else f"{rss / 2**20:.0f} MiB"


def _delta(delta: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in delta.items() if v)


def write_results(results: dict, *, json_path: str | None, save_dir: str | None) -> list[str]:
    return save_results(results, render_markdown, json_path=json_path, save_dir=save_dir)


def save_results(
    results: dict, render, *, json_path: str | None, save_dir: str | None
) -> list[str]:
    """Write the JSON and/or ``<save_dir>/<date>.json|md`` (markdown from ``render``); return
    the paths written. Shared by every benchmark in bench/."""
    targets = [(json_path, None)] if json_path else []
    if save_dir:
        base = os.path.join(save_dir, results["date"])
        targets += [(f"{base}.json", None), (f"{base}.md", render(results))]
    written = []
    for path, text in targets:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as out:
            out.write(text if text is not None else json.dumps(results, indent=2) + "\n")
        written.append(path)
    return written


def run_and_report(name: str, args, run, render) -> int:
    """The end of every benchmark's main(): run, then print the JSON (unless ``--json`` names a
    file) and the markdown report, and save them. Exit status 1 on a failed check, 130 when
    interrupted (SIGTERM/SIGHUP too: the runs clean up in their finally blocks)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    try:
        results = run(args)
    except BenchmarkFailure as exc:
        print(f"{name}: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted (processes stopped, mounts removed)", file=sys.stderr)
        return 130
    written = save_results(results, render, json_path=args.json, save_dir=args.save_dir)
    if not args.json:
        print(json.dumps(results, indent=2))
    print(render(results), file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def describe_machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


# --- the moto server and the worker ---------------------------------------------------------


class MotoProcess:
    """``python -m moto.server`` on 127.0.0.1, started and stopped by the bench."""

    def __init__(self, log_path: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed in stop()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **MOTO_ENV},
            start_new_session=True,
        )
        self._wait_ready(timeout=60)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BenchmarkFailure(f"moto server exited ({self._process.returncode})")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2) as reply:
                    reply.read()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise BenchmarkFailure(f"moto server did not answer on {self.endpoint} in {timeout}s")

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=MOTO_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=MOTO_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=32),
        )

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._log.close()


class WorkerProcess(processes.WorkerProcess):
    """``python -m cachefs up`` with its own state dir (emptied: a cold cache every run),
    RAM-tier dir and mount, in its own session; started at construction."""

    def __init__(
        self,
        workdir: str,
        *,
        ram: str,
        env: dict[str, str],
        extra_args: Sequence[str] = (),
        ram_dir: str | None = None,
    ):
        super().__init__(
            workdir,
            ram=ram,
            # Two workers of one bench process need two RAM-tier directories (``ram_dir``).
            ram_dir=ram_dir or f"/dev/shm/cachefs-read-bench-{os.getpid()}",
            extra_args=extra_args,
            env=env,
            log_level="WARNING",
            own_process_group=True,
            client_timeout=600,
        )
        if os.path.ismount(self.mount):
            raise BenchmarkFailure(f"{self.mount} is already mounted (another worker?)")
        shutil.rmtree(self.state, ignore_errors=True)  # a cold cache every run
        try:
            self.start(timeout=60)
        except processes.ProcessFailure as exc:
            self.stop()  # no half-started worker or RAM-tier directory left behind
            raise BenchmarkFailure(f"the cachefs worker: {exc}") from None
        except BaseException:
            self.stop()
            raise
        assert self.proc is not None
        #: The worker's process, kept after stop() (its pid names its CPU time and syscalls).
        self.process = self.proc

    def log_tail(self) -> str:
        return self.log()

    def counters(self) -> dict[str, int]:
        """Cumulative read counters of the worker (for per-pass deltas)."""
        status = self.client.status()
        reads = status["reads"]
        counters = {f"hits_{tier}": n for tier, n in reads["hits"].items()}
        counters["misses"] = reads["misses"]
        counters["store_gets"] = status["store"]["requests"].get("get:ok", 0)
        counters["worker_cpu_ms"] = round(1000 * self.cpu_seconds())
        counters["worker_write_syscalls"] = self.write_syscalls()
        return counters

    def cpu_seconds(self) -> float:
        """User + system CPU time the worker has used so far (all its threads), its child
        processes' included (the serving processes of ``--fuse-processes``)."""
        return processes.family_cpu_seconds(self.process.pid)

    def write_syscalls(self) -> int:
        """write/writev calls the worker has made: during a pass almost all are FUSE replies
        (one per request), so the delta per file counts the FUSE requests a file costs."""
        with open(f"/proc/{self.process.pid}/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("syscw:"))

    def check_alive(self) -> None:
        if self.process.poll() is not None or not os.path.ismount(self.mount):
            raise BenchmarkFailure(f"the cachefs worker died during a pass:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop it, unmount, remove its RAM-tier directory: the end of a run."""
        super().stop(timeout)
        self.client.close()
        shutil.rmtree(self.ram_dir, ignore_errors=True)


# --- the benchmark --------------------------------------------------------------------------


@dataclass
class Setup:
    plan: DatasetPlan
    order: list[int]
    sample_sha256: dict[int, str]
    thread_counts: list[int]
    repeats: int
    quiet_cpu: float = 1.0  # start a run once at most this share of the CPU is busy...
    quiet_wait_s: float = 0.0  # ...or once this long has passed


def run_repeats(
    setup: Setup,
    name: str,
    paths: Sequence[str],
    *,
    before_each: Callable[[], None] = lambda: None,
    worker: WorkerProcess | None = None,
    order: Sequence[int] | None = None,
    read_file: Callable[[str], bytes] | None = None,
) -> list[PassResult]:
    """Run one pass ``repeats`` times at every reader count; keep the best run of each."""
    sizes = [spec.size for spec in setup.plan.files]
    results = []
    for threads in setup.thread_counts:
        runs = []
        for _ in range(setup.repeats):
            # Wait first, prepare right before the run: a warm-up must not age while we wait
            # (this machine's DAMON reclaim pages out page cache unused for about a minute).
            busy = wait_for_quiet_cpu(setup.quiet_cpu, setup.quiet_wait_s)
            before_each()
            counters_before = worker.counters() if worker else {}
            run = read_pass(
                paths, sizes, order or setup.order, threads, setup.sample_sha256, read_file
            )
            run.cpu_busy_before = round(busy, 3)
            delta = {}
            if worker:
                worker.check_alive()
                after = worker.counters()
                delta = {k: after[k] - counters_before.get(k, 0) for k in after}
            runs.append((run, delta))
            print(
                f"  {name:<26} {threads} readers: {run.files / run.seconds:>9,.0f} files/s "
                f"{run.bytes / run.seconds / 1e9:6.3f} GB/s  (CPU busy before {busy:.0%})  "
                f"{_delta(delta)}",
                file=sys.stderr,
            )
        results.append(PassResult.best_of(name, threads, runs))
    return results


def tmpfs_passes(setup: Setup, source_dir: str) -> list[PassResult]:
    copy = f"/dev/shm/cachefs-read-bench-tmpfs-{os.getpid()}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source_dir, copy)
    try:
        paths = [os.path.join(copy, spec.path) for spec in setup.plan.files]
        return run_repeats(setup, "tmpfs_direct", paths)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def raw_get_passes(setup: Setup, moto: MotoProcess, sample: int) -> list[PassResult]:
    """boto3 GETs of whole objects (a shuffled subset: moto serves ~200 GET/s)."""
    client = moto.client()
    keys = [spec.path for spec in setup.plan.files]

    def get(key: str) -> bytes:
        return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    return run_repeats(setup, "backend_raw_get", keys, order=setup.order[:sample], read_file=get)


def cachefs_passes(
    setup: Setup,
    worker: WorkerProcess,
    dataset_spec: dict,
    profile: Sequence[str],
    profile_dir: str,
) -> tuple[list[PassResult], dict[str, dict]]:
    paths = [os.path.join(worker.mount, DATASET_NAME, spec.path) for spec in setup.plan.files]

    def fresh_dataset() -> None:
        """Nothing cached: remove the dataset with its blocks, add it again, drop the page
        cache (the new dataset also gets new inode numbers)."""
        if any(d["name"] == DATASET_NAME for d in worker.client.datasets()):
            worker.client.remove_dataset(DATASET_NAME)
        added = worker.client.add_dataset(dataset_spec)
        if added["files"] != len(setup.plan.files) or added["cached_bytes"] != 0:
            raise BenchmarkFailure(f"unexpected dataset after add: {added}")
        drop_page_cache()

    def warm_up() -> None:
        """Read everything once, untimed, so the page cache holds it right before the run."""
        sizes = [spec.size for spec in setup.plan.files]
        read_pass(paths, sizes, setup.order, max(setup.thread_counts), setup.sample_sha256)

    preparations = {
        "cachefs_first_read_store": fresh_dataset,
        "cachefs_first_read_ram": drop_page_cache,
        "cachefs_warm": warm_up,
    }
    results = []
    for name, before_each in preparations.items():
        results += run_repeats(setup, name, paths, before_each=before_each, worker=worker)
        if name == "cachefs_first_read_store":
            cached = worker.client.datasets()[0]["cached_fraction"]
            if cached < 1.0:
                raise BenchmarkFailure(
                    f"after the first reads only {cached:.0%} of the dataset is in the RAM "
                    "tier: the RAM-tier pass would not measure the RAM tier"
                )
    profiles = {}
    for short_name in profile:
        name = f"cachefs_{short_name}"
        profiles[name] = profile_pass(setup, worker, name, paths, preparations, profile_dir)
    return results, profiles


def profile_pass(
    setup: Setup,
    worker: WorkerProcess,
    name: str,
    paths: Sequence[str],
    preparations: dict[str, Callable[[], None]],
    profile_dir: str,
) -> dict:
    """One extra, untimed run of a pass at the largest reader count under py-spy."""
    if name not in preparations:
        raise BenchmarkFailure(f"no pass named {name!r} to profile")
    os.makedirs(profile_dir, exist_ok=True)
    output = os.path.join(profile_dir, f"{name}.collapsed.txt")
    preparations[name]()
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(worker.process.pid),
            "--rate",
            "250",
            "--format",
            "raw",
            "--native",
            "--output",
            output,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(1.0)  # py-spy attaches
    sizes = [spec.size for spec in setup.plan.files]
    threads = max(setup.thread_counts)
    run = read_pass(paths, sizes, setup.order, threads, setup.sample_sha256)
    spy.send_signal(signal.SIGINT)
    _, err = spy.communicate(timeout=60)
    if not os.path.exists(output):
        raise BenchmarkFailure(f"py-spy wrote no profile: {err.decode(errors='replace')[-2000:]}")
    summary = summarise_profile(output)
    summary.update(
        {"pass": name, "threads": threads, "files_per_s_under_profiler": run.files / run.seconds}
    )
    return summary


#: A sample whose stack holds one of these is a thread waiting, not working: py-spy --native
#: reports blocked threads too (trio's idle worker threads, the cache's flush thread).
IDLE_MARKERS = (
    "epoll_wait",
    "PyThread_acquire_lock_timed",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "sem_wait",
    "internal_select",  # a socket call waiting for the store to answer
)
#: Syscalls libfuse makes on /dev/fuse: reading a request, writing a reply (the kernel copies the
#: reply's data into the reader's pages and wakes it during the write).
FUSE_DEVICE_SYSCALLS = ("writev (", "read (", "splice (", "readv (")
#: Layers of the FUSE loop thread, first match names the sample.
LOOP_LAYERS = (
    ("cachefs handlers (FuseOperations.* and below)", ("fuse_ops.py",)),
    ("pyfuse3 + libfuse dispatch (receive, reply, coroutine plumbing)", ("pyfuse3", "libfuse")),
    ("control API (hypercorn)", ("hypercorn", "control.py", "h11")),
    ("trio scheduler", ("trio/",)),
)


def summarise_profile(collapsed_path: str) -> dict:
    """Where the worker's busy samples fall (py-spy ``--format raw`` collapsed stacks).

    Shares are of the FUSE loop thread's busy samples (the thread that runs ``cachefs up``'s
    trio loop, which serves every FUSE request): per layer (pyfuse3 dispatch vs cachefs
    handlers vs trio), per handler (inclusive), and the top leaf frames. Helper threads (store
    GETs, admissions) are counted apart.
    """
    idle = helper = 0
    loop: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    handlers: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    with open(collapsed_path) as stacks:
        for line in stacks:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            if any(marker in stack for marker in IDLE_MARKERS):
                idle += count
                continue
            if "cmd_up" not in stack:  # not the main thread, so not the FUSE loop
                helper += count
                continue
            frames = stack.split(";")
            loop["busy"] += count
            layers[_layer_of(stack)] += count
            leaves[frames[-1]] += count
            for handler in {f.split(" ")[0] for f in frames if "fuse_ops.py" in f}:
                handlers[handler] += count
    busy = loop["busy"]
    share = (lambda n: round(n / busy, 4)) if busy else (lambda n: 0.0)
    return {
        "samples": idle + helper + busy,
        "idle_samples": idle,
        "helper_thread_samples": helper,
        "fuse_loop_busy_samples": busy,
        "fuse_loop_by_layer": {k: share(v) for k, v in layers.most_common()},
        "fuse_loop_by_handler_inclusive": {k: share(v) for k, v in handlers.most_common()},
        "fuse_loop_top_leaf_frames": [[k, share(v)] for k, v in leaves.most_common(15)],
        "collapsed_stacks": collapsed_path,
    }


def _layer_of(stack: str) -> str:
    leaf = stack.rpartition(";")[2]
    if "libfuse" in stack and leaf.startswith(FUSE_DEVICE_SYSCALLS):
        return "kernel: /dev/fuse syscalls (request read, reply write incl. data copy)"
    for layer, needles in LOOP_LAYERS:
        if any(needle in stack for needle in needles):
            return layer
    return "other"


def lock_workdir(workdir: str, name: str = "read_bench"):
    """Hold ``workdir/<name>.lock`` for the caller's lifetime (return the open file).

    Two benchmarks sharing a work directory destroy each other (each starts by deleting the
    worker state there), so a second one is refused with the holder's pid.
    """
    os.makedirs(workdir, exist_ok=True)
    try:
        lock_file = take_pid_lock(os.path.join(workdir, f"{name}.lock"))
    except LockHeld as held:
        raise BenchmarkFailure(
            f"another {name} (pid {held.holder}) is using --workdir {workdir}: wait for it "
            "to finish or pass another --workdir"
        ) from None
    return lock_file


def run_benchmark(args: argparse.Namespace) -> dict:
    with lock_workdir(args.workdir):
        return _run_benchmark(args)


@dataclass
class Source:
    """Where the cachefs dataset reads from, as the worker and the report need it."""

    description: str
    dataset_spec: dict
    env: dict[str, str]  # for the worker process (credentials of the moto server)
    notes: list[str]


def make_setup(args: argparse.Namespace) -> Setup:
    plan = plan_dataset(args.files, classes=args.classes, seed=args.seed)
    order = list(range(len(plan.files)))
    random.Random(args.order_seed).shuffle(order)
    sample = random.Random(args.order_seed + 1).sample(order, min(args.sample, len(order)))
    sample_sha256 = {
        i: hashlib.sha256(file_bytes(plan.files[i], plan.seed)).hexdigest() for i in sample
    }
    thread_counts = sorted({int(t) for t in args.threads.split(",")})
    return Setup(
        plan, order, sample_sha256, thread_counts, args.repeats, args.quiet_cpu, args.quiet_wait
    )


def s3_source(
    setup: Setup, moto: MotoProcess, raw_get_files: int
) -> tuple[Source, list[PassResult]]:
    """Upload the dataset to moto and measure its raw GET rate."""
    print(f"uploading to moto at {moto.endpoint}", file=sys.stderr)
    client = moto.client()
    client.create_bucket(Bucket=BUCKET)
    upload_s3(client, BUCKET, "", setup.plan)
    passes = raw_get_passes(setup, moto, raw_get_files)
    source = Source(
        description=f"s3: moto_server {moto.endpoint} (started by the bench, in-memory)",
        dataset_spec={
            "name": DATASET_NAME,
            "uri": f"s3://{BUCKET}/",
            "endpoint": moto.endpoint,
            "region": MOTO_ENV["AWS_DEFAULT_REGION"],
            "path_style": True,
        },
        env=MOTO_ENV,
        notes=[
            f"backend_raw_get reads {min(raw_get_files, len(setup.order)):,} of the objects "
            "(whole-object boto3 GETs, one shared client)"
        ],
    )
    return source, passes


def file_source(setup: Setup, source_dir: str) -> tuple[Source, list[PassResult]]:
    """The generated directory itself is the source; measure plain cold reads of it."""
    paths = [os.path.join(source_dir, spec.path) for spec in setup.plan.files]
    passes = run_repeats(setup, "backend_raw_get", paths, before_each=drop_page_cache)
    source = Source(
        description=f"file: local directory {source_dir} on {_filesystem_of(source_dir)}",
        dataset_spec={"name": DATASET_NAME, "uri": f"file://{os.path.abspath(source_dir)}"},
        env={},
        notes=["backend_raw_get: plain reads of the source directory, page cache dropped"],
    )
    return source, passes


def _run_benchmark(args: argparse.Namespace) -> dict:
    setup = make_setup(args)
    source_dir = os.path.join(args.workdir, "source")
    print(f"generating {len(setup.plan.files):,} files in {source_dir}", file=sys.stderr)
    write_local(source_dir, setup.plan)
    load_before = list(os.getloadavg())
    print("tmpfs direct", file=sys.stderr)
    passes = tmpfs_passes(setup, source_dir)

    moto = worker = None
    try:
        if args.source == "s3":
            moto = MotoProcess(os.path.join(args.workdir, "moto.log"))
            source, backend_passes = s3_source(setup, moto, args.raw_get_files)
        else:
            source, backend_passes = file_source(setup, source_dir)
        passes += backend_passes
        ram = f"{max(1 << 30, 2 * setup.plan.total_bytes) >> 20}MiB"
        worker = WorkerProcess(
            args.workdir, ram=ram, env=source.env, extra_args=shlex.split(args.worker_args)
        )
        print(f"cachefs worker pid {worker.process.pid}, RAM tier {ram}", file=sys.stderr)
        cachefs_results, profiles = cachefs_passes(
            setup, worker, source.dataset_spec, args.profile, os.path.join(args.workdir, "profile")
        )
        passes += cachefs_results
        final_status = worker.client.status()
    finally:
        if worker:
            worker.stop()
        if moto:
            moto.stop()
    return assemble_results(args, setup, passes, source, final_status, load_before, profiles)


def assemble_results(
    args: argparse.Namespace,
    setup: Setup,
    passes: list[PassResult],
    source: Source,
    final_status: dict,
    load_before: list[float],
    profiles: dict[str, dict],
) -> dict:
    plan = setup.plan
    summary = size_summary(spec.size for spec in plan.files)
    pass_dicts = [asdict(p) for p in passes]
    ratios, targets = evaluate(pass_dicts, s3_source=args.source == "s3")
    results = {
        "benchmark": "cachefs single-node read",
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "dataset": {
            "files": len(plan.files),
            "classes": args.classes,
            "bytes": plan.total_bytes,
            "mean_size": summary["mean"],
            "median_size": summary["median"],
            "seed": plan.seed,
        },
        "source": source.description,
        "worker_args": args.worker_args,
        # Whether the kernel sends OPEN/RELEASE (see `cachefs up --fuse-no-open`).
        "worker_fuse_no_open": final_status.get("fuse_no_open"),
        "repeats": args.repeats,
        "order_seed": args.order_seed,
        "sample_files": len(setup.sample_sha256),
        "passes": pass_dicts,
        "worker_rss_bytes": final_status["rss_bytes"],
        "ratios": ratios,
        "targets": targets,
        "reference_files_per_s": REFERENCE_FILES_PER_S,
        "reference_note": "measured earlier on this machine type; not re-measured here",
        "notes": source.notes + sanity_notes(pass_dicts) + list(args.note or []),
    }
    if profiles:
        results["profiles"] = profiles
    return results


def _filesystem_of(path: str) -> str:
    result = subprocess.run(
        ["df", "--output=fstype", path], capture_output=True, text=True, check=False
    )
    return result.stdout.split()[-1] if result.returncode == 0 else "unknown filesystem"


PROFILABLE = ("first_read_store", "first_read_ram", "warm")


def _profile_choices(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PROFILABLE]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"cannot profile {', '.join(unknown)}: choose from {', '.join(PROFILABLE)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.read_bench", description=__doc__)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--order-seed", type=int, default=1, help="shuffled read order seed")
    parser.add_argument("--threads", default="1,4", help="reader counts, comma-separated")
    parser.add_argument("--source", choices=["s3", "file"], default="s3")
    parser.add_argument("--repeats", type=int, default=2, help="runs per pass; best kept")
    parser.add_argument("--sample", type=int, default=200, help="files sha256-checked per run")
    parser.add_argument("--raw-get-files", type=int, default=1000, help="objects per raw GET run")
    parser.add_argument(
        "--quiet-cpu",
        type=float,
        default=0.3,
        help="start each run once at most this share of the CPU is busy (shared machine)",
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=30.0, help="...or after this many seconds"
    )
    parser.add_argument("--workdir", default="/tmp/cachefs-read-bench")
    parser.add_argument("--json", help="write the JSON results here (default: stdout)")
    parser.add_argument("--save-dir", help="also write <dir>/<YYYY-MM-DD>.json and .md")
    parser.add_argument(
        "--profile",
        type=_profile_choices,
        default=[],
        help="comma-separated cachefs passes (first_read_store, first_read_ram, warm) to run "
        "once more, untimed, under py-spy",
    )
    parser.add_argument(
        "--worker-args",
        default="",
        help="extra `cachefs up` options for tuning experiments, e.g. '--max-tasks 8'",
    )
    parser.add_argument("--note", action="append", help="a note to store with the results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.geteuid() != 0:
        print("read_bench needs root (FUSE mount, drop_caches)", file=sys.stderr)
        return 2
    return run_and_report("read_bench", args, run_benchmark, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
