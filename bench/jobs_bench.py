"""Multi-job benchmark: per-job data-wait time without placement hints, with TDCS, and with
TDCS plus Suspend or Clone (P1's CacheManager), on one replayed trace.

    python -m bench.jobs_bench --nodes 4 --files 400 --jobs 10 --span 90s --store-delay-ms 20 \
        --seed 1 [--configs no-hints,tdcs,tdcs+suspend,tdcs+clone] [--save-dir DIR]

All real processes on loopback (needs root: FUSE mounts, drop_caches):

1. Two ImageNet-like datasets (bench/datagen.py), ``hot`` and ``cold`` (own prefixes, own bytes),
   are uploaded to a moto S3 server the bench starts. Workers reach it through
   ``bench/delay_proxy.py``, which adds ``--store-delay-ms`` to every request (a real object
   store's latency; loopback moto has none) and counts the GETs it forwards.
2. One trace is drawn from ``--seed``: job i arrives at a time spread over ``--span``, reads
   ``hot`` (~70 % of the jobs) or ``cold``, wants 1 or 2 nodes, and reads its whole dataset once
   (one epoch, its own shuffled order) split over its nodes, sleeping ``--compute-ms`` after
   each file (the emulated training step).
3. For each configuration, a fresh coordinator and ``--nodes`` workers; each dataset is added
   with its first copy on half the nodes (hot on the first half, cold on the second), both are
   preloaded fully, then the trace is replayed:
   - ``no-hints``: each job runs on nodes drawn at random (seeded, in the trace) among all nodes;
     the coordinator is not told about jobs.
   - ``tdcs``: each job is submitted to the CacheManager (``POST /v1/jobs``) with no per-copy
     limit and runs on the nodes it returns.
   - ``tdcs+suspend``: ``max_jobs_per_copy=2, overflow=suspend``: a suspended job long-polls
     (``GET /v1/jobs/{id}?wait=30``) and starts when promoted.
   - ``tdcs+clone``: ``max_jobs_per_copy=2, overflow=clone``: an over-limit job gets a new copy on
     other nodes, filled from peers while it reads.
   Registered jobs release themselves when done.
4. Each job node is one reader thread here, reading files through that node's mount. After each
   file ``posix_fadvise(DONTNEED)`` drops its pages, so every read reaches FUSE (checked per
   cluster: a second read of a file must be served by the worker again). Every file's length and
   xxh3 are checked against the generator's bytes: a wrong byte aborts the run.

Per job: queue wait (start - arrival), data-wait (seconds its readers spent inside open() and
read(), divided by its readers), run time, JCT, nodes, copy, cloned/suspended. Per
configuration: mean and p95 data-wait, mean queue wait, mean JCT, makespan, store GETs during the
trace, copies at the end. Output: JSON (stdout or ``--json``) and a markdown table with the
configurations side by side and ratios to ``no-hints`` (stderr); ``--save-dir`` writes
``<dir>/<YYYY-MM-DD>.json|md``. Workers, coordinators, the proxy, moto and the RAM-tier
directories are removed at the end, also on errors and Ctrl-C. Nothing here is imported by
cachefs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import xxhash

from bench.cluster_bench import (
    Cluster,
    _job_line,
    _load,
    busy_between,
    counter_delta,
    cpu_ticks,
    expected_hashes,
    git_head,
    ram_per_node,
    reader_split,
    worker_counters,
)
from bench.cluster_bench import (
    exact_command as cluster_command,
)
from bench.datagen import plan_dataset, size_summary, upload_s3
from bench.delay_proxy import fetch_stats, stats_delta
from bench.read_bench import (
    MOTO_ENV,
    BenchmarkFailure,
    MotoProcess,
    describe_machine,
    drop_page_cache,
    lock_workdir,
    run_and_report,
    save_results,
    wait_for_quiet_cpu,
)
from bench.suite.backend import ProxyProcess
from cachefs.units import parse_duration

CONFIGS = ("no-hints", "tdcs", "tdcs+suspend", "tdcs+clone")
BASELINE = "no-hints"
DATASETS = ("hot", "cold")
BUCKET = "cachefs-jobs-bench"
LONG_POLL_S = 30.0
PRELOAD_POLL_S = 0.25


@dataclass(frozen=True)
class ConfigSpec:
    register: bool  # jobs go through the CacheManager (else: random nodes, no coordinator)
    limited: bool  # max_jobs_per_copy applies
    overflow: str = "suspend"


CONFIG_SPECS = {
    "no-hints": ConfigSpec(register=False, limited=False),
    "tdcs": ConfigSpec(register=True, limited=False),
    "tdcs+suspend": ConfigSpec(register=True, limited=True, overflow="suspend"),
    "tdcs+clone": ConfigSpec(register=True, limited=True, overflow="clone"),
}


# --- the trace (pure; tested in tests/unit/bench/test_jobs_bench.py) ---------------------------


@dataclass(frozen=True)
class TraceJob:
    id: str
    arrival_s: float  # from the trace's start
    dataset: str
    nodes_wanted: int
    random_nodes: tuple[str, ...]  # no-hints placement, drawn with the trace
    order_seed: int  # the job's shuffled order of the dataset's files


def make_trace(
    jobs: int, span_s: float, nodes: Sequence[str], seed: int, hot_share: float = 0.7
) -> list[TraceJob]:
    """``jobs`` jobs, job i arriving at a random time within the i-th of ``jobs`` equal slots of
    ``span_s`` (so arrivals are increasing and spread over the span); round(hot_share × jobs)
    of them read ``hot``, in a random order; each wants 1 or 2 nodes (at most all of them)."""
    if jobs < 1:
        raise ValueError("a trace needs at least one job")
    if not nodes:
        raise ValueError("a trace needs at least one node")
    rng = random.Random(f"cachefs-jobs-bench/{seed}")
    hot = round(hot_share * jobs)
    datasets = ["hot"] * hot + ["cold"] * (jobs - hot)
    rng.shuffle(datasets)
    slot = span_s / jobs
    width = len(str(jobs))
    trace = []
    for i in range(jobs):
        wanted = min(rng.choice((1, 2)), len(nodes))
        trace.append(
            TraceJob(
                id=f"j{i + 1:0{width}d}",
                arrival_s=round((i + rng.random()) * slot, 3),
                dataset=datasets[i],
                nodes_wanted=wanted,
                random_nodes=tuple(rng.sample(list(nodes), wanted)),
                order_seed=rng.randrange(1 << 32),
            )
        )
    return trace


def job_order(job: TraceJob, files: int) -> list[int]:
    order = list(range(files))
    random.Random(job.order_seed).shuffle(order)
    return order


def first_copies(nodes: Sequence[str]) -> dict[str, list[str]]:
    """Nodes of each dataset's first copy: hot on the first half, cold on the second."""
    half = max(1, len(nodes) // 2)
    return {"hot": list(nodes[:half]), "cold": list(nodes[half:]) or list(nodes)}


# --- the summary (pure) ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals [start, end) open at one time."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, step in events:  # an end sorts before a start at the same time
        current += step
        peak = max(peak, current)
    return peak


def summarize(records: Sequence[dict]) -> dict:
    """Per-configuration numbers from its job records (times in seconds from the trace start)."""
    waits = [r["data_wait_s"] for r in records]
    peaks = {}
    for dataset in sorted({r["dataset"] for r in records}):
        spans = [(r["start_s"], r["finish_s"]) for r in records if r["dataset"] == dataset]
        peaks[dataset] = peak_concurrency(spans)
    return {
        "jobs": len(records),
        "mean_data_wait_s": mean(waits),
        "p95_data_wait_s": percentile(waits, 0.95),
        "max_data_wait_s": max(waits, default=0.0),
        "mean_queue_wait_s": mean([r["queue_wait_s"] for r in records]),
        "mean_run_s": mean([r["run_s"] for r in records]),
        "mean_jct_s": mean([r["jct_s"] for r in records]),
        "makespan_s": (
            max(r["finish_s"] for r in records) - min(r["arrival_s"] for r in records)
            if records
            else 0.0
        ),
        "suspended": sum(1 for r in records if r["suspended"]),
        "cloned": sum(1 for r in records if r["cloned"]),
        "peak_running_jobs": peaks,
    }


#: Metrics compared with no-hints. Not the queue wait: without a coordinator it is ~0 by
#: construction, so a ratio to it means nothing.
RATIO_KEYS = ("mean_data_wait_s", "p95_data_wait_s", "mean_jct_s", "makespan_s")


def ratios(summaries: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    """Each configuration's value ÷ the baseline's, per metric (None when the baseline did not
    run or is 0)."""
    base = summaries.get(baseline)
    out = {}
    for name, summary in summaries.items():
        out[name] = {
            key: (summary[key] / base[key] if base and base[key] else None) for key in RATIO_KEYS
        }
    return out


# --- reading -----------------------------------------------------------------------------------


@dataclass
class DatasetFiles:
    name: str
    keys: list[str]
    sizes: list[int]
    hashes: list[int]

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


@dataclass
class ReaderResult:
    node: str
    files: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # inside open() and read()
    seconds: float = 0.0  # the reader's whole time, compute included


def read_share(
    root: str,
    data: DatasetFiles,
    indices: Sequence[int],
    compute_s: float,
    node: str,
    abort: threading.Event | None = None,
    fadvise: bool = True,
) -> ReaderResult:
    """Read ``data.keys[i]`` under ``root`` for ``i`` in ``indices``: time open() + read(), drop
    the file's pages (``fadvise``), check length and xxh3 (BenchmarkFailure on a mismatch), then
    sleep ``compute_s``. Stops early when ``abort`` is set."""
    result = ReaderResult(node)
    began = time.perf_counter()
    for index in indices:
        if abort is not None and abort.is_set():
            break
        path = os.path.join(root, data.keys[index])
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            content = f.readall()
            result.wait_s += time.perf_counter() - t0
            if fadvise:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if len(content) != data.sizes[index]:
            raise BenchmarkFailure(
                f"{path}: read {len(content)} bytes, expected {data.sizes[index]}"
            )
        if xxhash.xxh3_64_intdigest(content) != data.hashes[index]:
            raise BenchmarkFailure(f"{path}: content differs from the source (xxh3)")
        result.files += 1
        result.bytes += len(content)
        if compute_s:
            time.sleep(compute_s)
    result.seconds = time.perf_counter() - began
    return result


def job_record(
    job: TraceJob,
    *,
    arrival_s: float,
    start_s: float,
    finish_s: float,
    readers: Sequence[ReaderResult],
    copy: str | None,
    cloned: bool,
    suspended: bool,
) -> dict:
    return {
        "job": job.id,
        "dataset": job.dataset,
        "nodes_wanted": job.nodes_wanted,
        "planned_arrival_s": job.arrival_s,
        "arrival_s": arrival_s,
        "start_s": start_s,
        "finish_s": finish_s,
        "queue_wait_s": start_s - arrival_s,
        "data_wait_s": sum(r.wait_s for r in readers) / max(1, len(readers)),
        "run_s": finish_s - start_s,
        "jct_s": finish_s - arrival_s,
        "nodes": [r.node for r in readers],
        "copy": copy,
        "cloned": cloned,
        "suspended": suspended,
        "files": sum(r.files for r in readers),
        "bytes": sum(r.bytes for r in readers),
        "readers": [asdict(r) for r in readers],
    }


@dataclass
class Replay:
    """One configuration's replay of the trace on a started cluster."""

    cluster: Cluster
    spec: ConfigSpec
    data: dict[str, DatasetFiles]
    compute_s: float
    abort: threading.Event = field(default_factory=threading.Event)
    records: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    t0: float = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, trace: Sequence[TraceJob], timeout_s: float) -> list[dict]:
        threads = [
            threading.Thread(target=self._job, args=(job,), name=job.id, daemon=True)
            for job in trace
        ]
        self.t0 = time.perf_counter() + 0.2
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(t.is_alive() for t in threads) and not self.abort.is_set():
                next(t for t in threads if t.is_alive()).join(timeout=1.0)
                self.cluster.check_alive()
                if time.monotonic() > deadline:
                    raise BenchmarkFailure(
                        f"the trace did not end in {timeout_s:.0f} s; jobs still running: "
                        f"{', '.join(t.name for t in threads if t.is_alive())}"
                    )
        finally:
            self.abort.set()  # stops the jobs that are left (none, when all went well)
        if self.errors:
            raise BenchmarkFailure(f"{len(self.errors)} job(s) failed; first: {self.errors[0]}")
        return sorted(self.records, key=lambda r: r["job"])

    def _job(self, job: TraceJob) -> None:
        try:
            delay = job.arrival_s - self.now()
            if delay > 0:
                time.sleep(delay)
            if self.abort.is_set():
                return
            record = self._run_job(job)
            with self.lock:
                self.records.append(record)
        except Exception as exc:  # reported by run(), never lost in a thread
            with self.lock:
                self.errors.append(f"job {job.id}: {type(exc).__name__}: {exc}")
            self.abort.set()

    def _run_job(self, job: TraceJob) -> dict:
        from cachefs.client import CoordinatorClient

        arrival = self.now()
        copy, cloned, suspended = None, False, False
        client = None
        if self.spec.register:
            client = CoordinatorClient(self.cluster.url, self.cluster.token, timeout=30)
            doc = client.submit_job(job.id, job.dataset, job.nodes_wanted)
            suspended = doc["state"] == "suspended"
            while doc["state"] != "running":
                if self.abort.is_set():
                    client.close()
                    raise BenchmarkFailure("aborted while suspended")
                doc = client.job(job.id, wait_s=LONG_POLL_S)
            names, copy, cloned = doc["nodes"], doc["copy"], bool(doc.get("cloned"))
        else:
            names = list(job.random_nodes)
        try:
            start = self.now()
            data = self.data[job.dataset]
            order = job_order(job, len(data.keys))
            by_name = {node.name: node for node in self.cluster.nodes}
            results: list[ReaderResult | None] = [None] * len(names)
            failures: list[str] = []

            def reader(slot: int, name: str, indices: list[int]) -> None:
                try:
                    root = os.path.join(by_name[name].mount, job.dataset)
                    results[slot] = read_share(
                        root, data, indices, self.compute_s, name, self.abort
                    )
                except Exception as exc:
                    failures.append(f"reader on {name}: {type(exc).__name__}: {exc}")
                    self.abort.set()

            readers = [
                threading.Thread(target=reader, args=(slot, name, part), daemon=True)
                for slot, (name, part) in enumerate(
                    zip(names, reader_split(order, len(names)), strict=True)
                )
            ]
            for thread in readers:
                thread.start()
            for thread in readers:
                thread.join()
            finish = self.now()
            if failures:
                raise BenchmarkFailure(failures[0])
            if self.abort.is_set():
                raise BenchmarkFailure("aborted (another job failed)")
        finally:
            if client is not None:
                try:
                    client.release_job(job.id)
                finally:
                    client.close()
        return job_record(
            job,
            arrival_s=arrival,
            start_s=start,
            finish_s=finish,
            readers=[r for r in results if r is not None],
            copy=copy,
            cloned=cloned,
            suspended=suspended,
        )


# --- one configuration -------------------------------------------------------------------------


def dataset_spec(name: str, endpoint: str, nodes: list[str], spec: ConfigSpec, limit: int):
    body = {
        "name": name,
        "uri": f"s3://{BUCKET}/{name}",
        "endpoint": endpoint,
        "region": MOTO_ENV["AWS_DEFAULT_REGION"],
        "path_style": True,
        "nodes": nodes,
    }
    if spec.limited:
        body["max_jobs_per_copy"] = limit
        body["overflow"] = spec.overflow
    return body


def preload_all(cluster: Cluster, data: dict[str, DatasetFiles], timeout: float) -> float:
    """Preload every dataset fully (its first copy); seconds until all are completed."""
    client = cluster.client
    began = time.monotonic()
    for name in data:
        client.preload(name)
    pending = set(data)
    while pending:
        for name in sorted(pending):
            job = client.preload_status(name)
            if job["state"] in ("running", "scheduled"):
                continue
            if job["state"] != "completed" or job["failed_count"]:
                raise BenchmarkFailure(
                    f"preload of {name} ended {job['state']}: {_job_line(job)}; failures: "
                    f"{job['failed'][:5]}\n{cluster.log_tails()}"
                )
            if job["objects_done"] != len(data[name].keys) or job["bytes_done"] != data[name].bytes:
                raise BenchmarkFailure(f"preload of {name} completed short: {_job_line(job)}")
            pending.discard(name)
        cluster.check_alive()
        if pending and time.monotonic() - began > timeout:
            lines = "; ".join(f"{n}: {_job_line(client.preload_status(n))}" for n in pending)
            raise BenchmarkFailure(f"preload not over after {timeout:.0f} s: {lines}")
        time.sleep(PRELOAD_POLL_S)
    seconds = time.monotonic() - began
    # The ranking reads cached bytes from heartbeats: wait until they count everything.
    deadline = time.monotonic() + 30
    for name, files in data.items():
        while (cached := client.locality(name)["cached_bytes"]) < files.bytes:
            if time.monotonic() > deadline:
                raise BenchmarkFailure(
                    f"after the preload the locality API counts {cached:,} cached bytes of "
                    f"{name}, of {files.bytes:,}"
                )
            time.sleep(0.25)
    return seconds


def check_fadvise(cluster: Cluster, data: DatasetFiles) -> dict:
    """Read one file twice through n1's mount with DONTNEED after each read: the second read
    must be served by the worker again (its bytes_served grows by the file's size)."""
    node = cluster.nodes[0]
    root = os.path.join(node.mount, data.name)
    before = worker_counters(node.status())
    read_share(root, data, [0], 0.0, node.name)
    middle = worker_counters(node.status())
    read_share(root, data, [0], 0.0, node.name)
    after = worker_counters(node.status())

    def served(a: dict, b: dict) -> int:
        return sum(v for k, v in counter_delta(a, b).items() if k.startswith("served_"))

    first, second = served(before, middle), served(middle, after)
    return {
        "file_bytes": data.sizes[0],
        "first_read_served": first,
        "second_read_served": second,
        "effective": second >= data.sizes[0],
    }


def totals(counters: dict[str, dict[str, int]]) -> dict[str, int]:
    """Sum of every worker's counters."""
    out: dict[str, int] = {}
    for per_node in counters.values():
        for key, value in per_node.items():
            out[key] = out.get(key, 0) + value
    return out


def fill_bytes(status: dict) -> int:
    return (status.get("fill") or {}).get("bytes", 0)


def config_dir(name: str) -> str:
    return name.replace("+", "-")


def run_config(name: str, ctx: RunContext) -> dict:
    spec = CONFIG_SPECS[name]
    args = ctx.args
    workdir = os.path.join(ctx.run_dir, config_dir(name))
    os.makedirs(workdir)
    cluster = Cluster(workdir, args, ctx.ram)
    try:
        print(f"[{name}] starting a coordinator and {args.nodes} workers", file=sys.stderr)
        cluster.start()
        names = [n.name for n in cluster.nodes]
        copies = first_copies(names)
        for dataset in ctx.data:
            body = dataset_spec(
                dataset, ctx.proxy_url, copies[dataset], spec, args.max_jobs_per_copy
            )
            cluster.add_dataset(body)
        print(f"[{name}] preloading {', '.join(ctx.data)} fully", file=sys.stderr)
        preload_s = preload_all(cluster, ctx.data, args.preload_timeout)
        fadvise = check_fadvise(cluster, ctx.data["hot"])
        if not fadvise["effective"]:
            print(
                f"[{name}] WARNING: posix_fadvise(DONTNEED) did not make the second read reach "
                f"the worker: {fadvise}",
                file=sys.stderr,
            )
        busy = wait_for_quiet_cpu(args.quiet_cpu, args.quiet_wait)
        drop_page_cache()
        before = {n.name: worker_counters(n.status()) for n in cluster.nodes}
        fill_before = sum(fill_bytes(n.status()) for n in cluster.nodes)
        proxy_before = fetch_stats(ctx.proxy_url)
        ticks = cpu_ticks()
        print(f"[{name}] replaying {len(ctx.trace)} jobs over {args.span_s:.0f} s", file=sys.stderr)
        replay = Replay(cluster, spec, ctx.data, args.compute_ms / 1000)
        records = replay.run(ctx.trace, args.span_s + args.trace_timeout)
        ticks_after = cpu_ticks()
        proxy = stats_delta(proxy_before, fetch_stats(ctx.proxy_url))
        statuses = {n.name: n.status() for n in cluster.nodes}
        after = {node: worker_counters(s) for node, s in statuses.items()}
        workers = counter_delta(totals(before), totals(after))
        end_copies = {
            dataset: [
                {
                    "id": c["id"],
                    "nodes": c["nodes"],
                    "origin": c["origin"],
                    "fill_copied_bytes": (c.get("fill") or {}).get("copied_bytes"),
                }
                for c in cluster.client.dataset(dataset)["copies"]
            ]
            for dataset in ctx.data
        }
        events = cluster.client.events(limit=1000)
        summary = summarize(records)
        print(
            f"[{name}] mean data-wait {summary['mean_data_wait_s']:.3f} s, p95 "
            f"{summary['p95_data_wait_s']:.3f} s, mean JCT {summary['mean_jct_s']:.2f} s, "
            f"makespan {summary['makespan_s']:.1f} s, {proxy['object_gets']} store GETs",
            file=sys.stderr,
        )
        limit = {"max_jobs_per_copy": args.max_jobs_per_copy if spec.limited else None}
        return {
            "config": name,
            "spec": asdict(spec) | limit,
            "first_copies": copies,
            "preload_s": preload_s,
            "fadvise_check": fadvise,
            "cpu_busy_before": round(busy, 3),
            "cpu_busy_during": round(busy_between(ticks, ticks_after), 3),
            "summary": summary,
            "store": {
                "object_gets": proxy["object_gets"],
                "proxy": proxy,
                "worker_store_gets": workers.get("store_gets", 0),
            },
            "served_bytes": {
                "local": workers.get("served_ram", 0) + workers.get("served_ssd", 0),
                "peer": workers.get("served_peer", 0),
                "recent": workers.get("served_recent", 0),
                "store": workers.get("served_store", 0),
            },
            "fill_bytes": sum(fill_bytes(s) for s in statuses.values()) - fill_before,
            "workers": workers,
            "workers_by_node": {
                node: {k: v for k, v in counter_delta(before[node], after[node]).items() if v}
                for node in after
            },
            "copies_at_end": end_copies,
            "events": [e for e in events if e.get("kind") in ("clone", "job")],
            "jobs": records,
        }
    except BenchmarkFailure as exc:
        raise BenchmarkFailure(f"[{name}] {exc}\n{cluster.log_tails()}") from exc
    except Exception as exc:
        raise BenchmarkFailure(
            f"[{name}] {type(exc).__name__}: {exc}\n{cluster.log_tails()}"
        ) from exc
    finally:
        print(f"[{name}] stopping the cluster", file=sys.stderr)
        cluster.stop()


# --- the run -----------------------------------------------------------------------------------


@dataclass
class RunContext:
    args: argparse.Namespace
    run_dir: str
    trace: list[TraceJob]
    data: dict[str, DatasetFiles]
    ram: str
    proxy_url: str = ""


def make_data(args: argparse.Namespace) -> dict[str, DatasetFiles]:
    """hot and cold: same layout, different bytes (seeds ``--data-seed`` and +1)."""
    data = {}
    for offset, name in enumerate(DATASETS):
        plan = plan_dataset(args.files, classes=args.classes, seed=args.data_seed + offset)
        data[name] = DatasetFiles(
            name=name,
            keys=[spec.path for spec in plan.files],
            sizes=[spec.size for spec in plan.files],
            hashes=expected_hashes(plan),
        )
    return data


def run_benchmark(args: argparse.Namespace) -> dict:
    with lock_workdir(args.workdir, "jobs_bench"):
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    run_dir = os.path.join(args.workdir, "run")
    for config in CONFIGS:
        for i in range(1, 251):
            leftover = os.path.join(run_dir, config_dir(config), f"m{i}")
            if os.path.ismount(leftover):
                raise BenchmarkFailure(f"{leftover} is still mounted (an earlier run?): umount it")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    started = time.time()
    load_before = list(os.getloadavg())
    print(f"planning 2 x {args.files:,} files, hashing their bytes", file=sys.stderr)
    data = make_data(args)
    names = [f"n{i}" for i in range(1, args.nodes + 1)]  # as Cluster names them
    trace = make_trace(args.jobs, args.span_s, names, args.seed, args.hot_share)
    total = sum(d.bytes for d in data.values())
    ram = ram_per_node(total, 1, args.ram)  # auto: room for a whole copy of both datasets
    ctx = RunContext(args, run_dir, trace, data, ram)
    moto = proxy = None
    configs: dict[str, dict] = {}
    try:
        moto = MotoProcess(os.path.join(run_dir, "moto.log"))
        print(f"uploading to moto at {moto.endpoint}", file=sys.stderr)
        s3 = moto.client()
        s3.create_bucket(Bucket=BUCKET)
        for name in DATASETS:
            plan = plan_dataset(
                args.files, classes=args.classes, seed=args.data_seed + DATASETS.index(name)
            )
            upload_s3(s3, BUCKET, f"{name}/", plan, threads=8)
        proxy = ProxyProcess(
            moto.endpoint, args.store_delay_ms, os.path.join(run_dir, "delay_proxy.log")
        )
        ctx.proxy_url = proxy.url
        print(f"delay proxy {proxy.url} (+{args.store_delay_ms} ms per request)", file=sys.stderr)
        for name in args.configs:
            configs[name] = run_config(name, ctx)
    finally:
        print("cleaning up", file=sys.stderr)
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.stop()
    return assemble(args, ctx, configs, load_before, started)


def config_notes(name: str, c: dict, limit: int) -> list[str]:
    """Warnings when a configuration's counters contradict what it claims to measure."""
    notes = []
    if not c["fadvise_check"]["effective"]:
        notes.append(
            f"{name}: posix_fadvise(DONTNEED) did not send a re-read to the worker "
            f"({c['fadvise_check']}): repeated reads of a file on one node may have come "
            "from the page cache"
        )
    if c["store"]["object_gets"]:
        notes.append(
            f"{name}: {c['store']['object_gets']:,} object GETs reached the store during the "
            "trace (both datasets were preloaded)"
        )
    unanswered = {
        k.removeprefix("peer_req_"): v
        for k, v in c["workers"].items()
        if k.startswith("peer_req_") and not k.endswith("ok") and v
    }
    if unanswered:
        notes.append(
            f"{name}: peer requests not ok during the trace: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(unanswered.items()))
            + " (a failed or cooling peer read goes to the store instead; see the worker logs)"
        )
    summary = c["summary"]
    if CONFIG_SPECS[name].limited and not (summary["suspended"] or summary["cloned"]):
        notes.append(
            f"{name}: no job was over max_jobs_per_copy={limit} (peak running jobs per "
            f"dataset: {summary['peak_running_jobs']}), so the limit never applied and this is "
            "tdcs again; a shorter --span or a longer --compute-ms overlaps more jobs"
        )
    return notes


def assemble(args, ctx: RunContext, configs: dict[str, dict], load_before, started) -> dict:
    summaries = {name: c["summary"] for name, c in configs.items()}
    notes = list(args.note or [])
    for name, config in configs.items():
        notes += config_notes(name, config, args.max_jobs_per_copy)
    return {
        "benchmark": "cachefs jobs: data-wait without hints, with TDCS, Suspend, Clone",
        "date": datetime.date.today().isoformat(),
        "started_at": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "command": exact_command(),
        "git": git_head(),
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "cluster": {
            "nodes": args.nodes,
            "heartbeat_interval": "0.5s",
            "preload_processes": args.preload_processes,
            "ram_per_node": ctx.ram,
            "worker_args": args.worker_args,
        },
        "datasets": {
            name: {
                "files": len(d.keys),
                "bytes": d.bytes,
                "mean_size": size_summary(d.sizes)["mean"],
                "seed": args.data_seed + DATASETS.index(name),
                "prefix": f"s3://{BUCKET}/{name}/",
            }
            for name, d in ctx.data.items()
        },
        "store": f"moto_server (in-memory) behind bench/delay_proxy.py, +{args.store_delay_ms} ms "
        "per request",
        "trace": {
            "seed": args.seed,
            "jobs": args.jobs,
            "span_s": args.span_s,
            "hot_share": args.hot_share,
            "compute_ms_per_file": args.compute_ms,
            "max_jobs_per_copy": args.max_jobs_per_copy,
            "jobs_list": [asdict(job) for job in ctx.trace],
        },
        "verification": "every length and every file's xxh3_64 against the generator's bytes; "
        "posix_fadvise(DONTNEED) after each file",
        "configs": configs,
        "summary": summaries,
        "ratios_vs_no_hints": ratios(summaries) if BASELINE in summaries else {},
        "notes": notes,
    }


def exact_command() -> str:
    return cluster_command().replace("-m bench.cluster_bench", "-m bench.jobs_bench", 1)


# --- report ------------------------------------------------------------------------------------


def _ratio_cell(value: float, ratio: float | None, fmt: str) -> str:
    cell = format(value, fmt)
    return cell if ratio is None else f"{cell} ({ratio:.2f}x)"


def summary_rows(results: dict) -> list[str]:
    """The side-by-side table: one column per configuration, ratios to no-hints in brackets."""
    configs = results["configs"]
    names = [n for n in CONFIGS if n in configs]
    rat = results.get("ratios_vs_no_hints") or {}
    lines = [
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(n, configs[n]) for n in names) + " |")

    def timed(key: str, fmt: str = ".3f"):
        def cell(name: str, c: dict) -> str:
            r = (rat.get(name) or {}).get(key) if name != BASELINE else None
            return _ratio_cell(c["summary"][key], r, fmt)

        return cell

    row("mean data-wait per job (s)", timed("mean_data_wait_s"))
    row("p95 data-wait per job (s)", timed("p95_data_wait_s"))
    row("mean queue wait (s)", lambda n, c: f"{c['summary']['mean_queue_wait_s']:.3f}")
    row("mean JCT (s)", timed("mean_jct_s", ".2f"))
    row("makespan (s)", timed("makespan_s", ".1f"))
    row("mean run time (s)", lambda n, c: f"{c['summary']['mean_run_s']:.2f}")
    row(
        "jobs suspended / cloned",
        lambda n, c: f"{c['summary']['suspended']} / {c['summary']['cloned']}",
    )
    row(
        "peak running jobs (hot / cold)",
        lambda n, c: " / ".join(str(c["summary"]["peak_running_jobs"].get(d, 0)) for d in DATASETS),
    )
    row("store object GETs during the trace", lambda n, c: f"{c['store']['object_gets']:,}")
    row(
        "MB served: local tiers / peers / store",
        lambda n, c: " / ".join(
            f"{c['served_bytes'][k] / 1e6:.1f}" for k in ("local", "peer", "store")
        ),
    )
    row("MB copied by clone fills", lambda n, c: f"{c['fill_bytes'] / 1e6:.1f}")
    row(
        "copies at the end (hot / cold)",
        lambda n, c: " / ".join(
            ", ".join(f"{x['id']}: {'+'.join(x['nodes'])}" for x in c["copies_at_end"][d])
            for d in DATASETS
        ),
    )
    row(
        "CPU busy: during trace (before)",
        lambda n, c: f"{c['cpu_busy_during']:.0%} ({c['cpu_busy_before']:.0%})",
    )
    return lines


def render_markdown(results: dict) -> str:
    m, c, t = results["machine"], results["cluster"], results["trace"]
    git = results.get("git") or {}
    datasets = "; ".join(
        f"{name}: {d['files']:,} files, {d['bytes'] / 1e6:,.1f} MB (seed {d['seed']})"
        for name, d in results["datasets"].items()
    )
    first = next(iter(results["configs"].values()), {}).get("first_copies", {})
    lines = [
        f"## cachefs jobs benchmark — {results['date']}",
        "",
        f"- command: `{results['command']}`",
        f"- machine: {m['nproc']} cores, {m['memory_bytes'] / 2**30:.1f} GiB RAM, kernel "
        f"{m['kernel']}, Python {m['python']}",
        f"- cachefs at {git.get('head') or '?'}"
        + (" (working tree with uncommitted changes)" if git.get("uncommitted_changes") else ""),
        f"- load average (1/5/15 min) before: {_load(results['load_before'])}, after: "
        f"{_load(results['load_after'])}",
        f"- cluster per configuration (fresh each time): coordinator + {c['nodes']} workers on "
        f"127.0.0.2.., RAM tier {c['ram_per_node']} each, heartbeat {c['heartbeat_interval']}",
        f"- datasets: {datasets}; first copies: "
        + ", ".join(f"{d} on {'+'.join(nodes)}" for d, nodes in first.items())
        + "; both preloaded fully before the trace",
        f"- store: {results['store']}",
        f"- trace (seed {t['seed']}): {t['jobs']} jobs over {t['span_s']:.0f} s, "
        f"{t['hot_share']:.0%} on hot, 1 or 2 nodes each, one epoch each, "
        f"{t['compute_ms_per_file']:g} ms compute per file; limit for suspend/clone: "
        f"{t['max_jobs_per_copy']} jobs per copy",
        f"- verification: {results['verification']}",
        "",
        "### Per configuration (lower is better; in brackets: ratio to no-hints)",
        "",
        *summary_rows(results),
        "",
        "data-wait = seconds a job's readers spent inside open() and read() of its files, "
        "divided by its readers; queue wait = start - arrival; JCT = finish - arrival; "
        "makespan = last finish - first arrival.",
        "",
        "### Trace",
        "",
        "| job | arrival (s) | dataset | nodes wanted | no-hints nodes |",
        "|---|---:|---|---:|---|",
    ]
    for job in t["jobs_list"]:
        lines.append(
            f"| {job['id']} | {job['arrival_s']:.1f} | {job['dataset']} | {job['nodes_wanted']} "
            f"| {', '.join(job['random_nodes'])} |"
        )
    for name in CONFIGS:
        config = results["configs"].get(name)
        if config is None:
            continue
        lines += [
            "",
            f"### Jobs: {name}",
            "",
            "| job | dataset | nodes | copy | | queue wait (s) | data-wait (s) | run (s) "
            "| JCT (s) |",
            "|---|---|---|---|---|---:|---:|---:|---:|",
        ]
        for r in config["jobs"]:
            flags = ", ".join(
                f for f, on in (("suspended", r["suspended"]), ("cloned", r["cloned"])) if on
            )
            lines.append(
                f"| {r['job']} | {r['dataset']} | {', '.join(r['nodes'])} | {r['copy'] or '—'} "
                f"| {flags} | {r['queue_wait_s']:.2f} | {r['data_wait_s']:.3f} "
                f"| {r['run_s']:.2f} | {r['jct_s']:.2f} |"
            )
    if results.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def write_results(results: dict, *, json_path: str | None, save_dir: str | None) -> list[str]:
    return save_results(results, render_markdown, json_path=json_path, save_dir=save_dir)


# --- command line ------------------------------------------------------------------------------


def parse_configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIG_SPECS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(CONFIGS)}"
        )
    return [n for n in CONFIGS if n in names]  # always in the report's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.jobs_bench", description=__doc__)
    parser.add_argument("--nodes", type=int, default=4, help="workers (at most 250)")
    parser.add_argument("--files", type=int, default=400, help="files per dataset")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--data-seed", type=int, default=0, help="hot's seed; cold uses +1")
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--span", default="90s", help="arrivals are spread over this")
    parser.add_argument("--seed", type=int, default=1, help="trace seed")
    parser.add_argument("--hot-share", type=float, default=0.7, help="share of jobs on hot")
    parser.add_argument("--compute-ms", type=float, default=1.0, help="emulated compute per file")
    parser.add_argument("--max-jobs-per-copy", type=int, default=2)
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=list(CONFIGS),
        help=f"comma-separated, from {','.join(CONFIGS)}",
    )
    parser.add_argument(
        "--preload-processes", type=int, default=2, help="fetcher processes per worker"
    )
    parser.add_argument("--ram", default="auto", help="RAM tier per worker (auto: see README)")
    parser.add_argument("--preload-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument(
        "--trace-timeout", type=float, default=600.0, help="seconds after the span before giving up"
    )
    parser.add_argument("--quiet-cpu", type=float, default=0.3)
    parser.add_argument("--quiet-wait", type=float, default=10.0)
    parser.add_argument("--workdir", default="/tmp/cachefs-jobs-bench")
    parser.add_argument("--worker-args", default="", help="extra `cachefs worker` options")
    parser.add_argument("--json", help="write the JSON here (default: stdout)")
    parser.add_argument("--save-dir", help="also write <dir>/<YYYY-MM-DD>.json and .md")
    parser.add_argument("--note", action="append", help="a note to store with the results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.span_s = parse_duration(args.span)
    if not 2 <= args.nodes <= 250:
        print("jobs_bench: --nodes must be 2-250", file=sys.stderr)
        return 2
    if args.jobs < 1 or args.files < 1 or args.span_s < 0 or args.max_jobs_per_copy < 1:
        print("jobs_bench: --jobs, --files, --max-jobs-per-copy >= 1, --span >= 0", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("jobs_bench needs root (FUSE mounts, drop_caches)", file=sys.stderr)
        return 2
    return run_and_report("jobs_bench", args, run_benchmark, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
