"""What one client process drives against a store, and what the preloader reaches beside it.

    python -m bench.store_fetch_rate [--objects 1500] [--size 110KB] [--delay-ms 0|20]
        [--threads 1,4,16,64] [--processes 2] [--endpoint URL] [--skip PHASE,...]

Serves ``--objects`` files of ``--size`` bytes from a temporary directory with ``bench.lean_s3``
(or uses ``--endpoint``, e.g. a moto server with a bucket ``bench`` holding the keys
``obj/NNNNN``), optionally behind ``bench.delay_proxy`` (``--delay-ms`` first-byte latency, in
a process of its own), and measures, each over every object once:

1. ``raw``: a plain boto3 GET loop (ranged, with If-Match, as cachefs sends them) in ONE
   process with ``T`` threads, for each ``T`` of ``--threads``: GETs/s, and that process's CPU
   per GET (user + system, from getrusage);
2. ``lean``: the same loop through cachefs's lean bulk-GET client
   (:class:`cachefs.store.s3_bulk.S3BulkReader`: its own SigV4 signer over pooled keep-alive
   HTTP/1.1 connections, with cachefs's retries and hedging), same process layout and measures;
3. ``fetcher`` and ``fetcher-boto3``: the same GETs through ONE cachefs fetcher process
   (``FetcherPool(1)``) with ``T`` requests in flight, reading with the lean client (the
   default) or with S3Store (boto3, ``lean_s3=False``): GETs/s, and the fetcher process's CPU
   per GET (from /proc);
4. ``preload`` and ``preload-boto3``: the worker's :class:`~cachefs.cluster.preload.Preloader`
   with ``--processes`` fetcher processes (lean client, or boto3) and its adaptive concurrency,
   into a RAM tier: objects/s against the best raw rates, and the concurrency it settled on
   (printed). As the other rows' clients are, the fetcher processes are started (and their
   store clients opened, by one 1-byte GET each) before the clock starts: a worker starts its
   pool once, at its first preload, and keeps it. That start is reported beside the row
   (``fetchers_start_s``, its CPU in ``fetchers_start_cpu_s``): what a worker's first preload
   pays once, ~1/3 of a 3,000-object preload's time here.

Timings are reported, never asserted. Run it on a quiet machine (it uses every core it gets).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import trio

from cachefs.units import parse_size
from harness.processes import cpu_seconds

BUCKET = "bench"
#: Where the preload rows keep their RAM tier: tmpfs where there is one.
RAM_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def key_of(index: int) -> str:
    return f"obj/{index:05d}"


def _forkserver_cpu() -> float:
    """CPU seconds of multiprocessing's forkserver (the fetchers' parent), 0 if none runs."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return cpu_seconds(pid) if pid else 0.0


def _raw_process(endpoint, objects, size, threads, etags, out) -> None:
    import boto3
    import botocore.config

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=botocore.config.Config(
            max_pool_connections=threads,
            retries={"total_max_attempts": 1},
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )

    def get(index: int) -> bytes:
        return s3.get_object(
            Bucket=BUCKET,
            Key=key_of(index),
            Range=f"bytes=0-{size - 1}",
            IfMatch=f'"{etags[index]}"',
        )["Body"].read()

    _loop(get, objects, size, threads, out)


def _lean_process(endpoint, objects, size, threads, etags, out) -> None:
    from cachefs.store import StoreConfig
    from cachefs.store.s3_bulk import S3BulkReader

    reader = S3BulkReader(StoreConfig(f"s3://{BUCKET}/", endpoint=endpoint, dataset="bench"))

    def get(index: int) -> bytes:
        return reader.get_range(key_of(index), 0, size, etag=etags[index])

    _loop(get, objects, size, threads, out)
    reader.close()


def _loop(get, objects, size, threads, out) -> None:
    """Every object once with ``get(index)`` from ``threads`` threads; this process's CPU."""
    errors = []

    def getter(indices) -> None:
        for index in indices:
            try:
                if len(get(index)) != size:
                    errors.append("short body")
            except Exception as exc:
                errors.append(type(exc).__name__)

    workers = [
        threading.Thread(target=getter, args=(range(t, objects, threads),)) for t in range(threads)
    ]
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    out.put({"seconds": seconds, "cpu_s": cpu, "errors": errors[:3], "error_count": len(errors)})


def raw_get(endpoint: str, objects: int, size: int, threads: int, etags: list[str]) -> dict:
    return _in_process(_raw_process, "raw boto3 loop", endpoint, objects, size, threads, etags)


def lean_get(endpoint: str, objects: int, size: int, threads: int, etags: list[str]) -> dict:
    return _in_process(
        _lean_process, "raw lean-client loop", endpoint, objects, size, threads, etags
    )


def _in_process(target, what, endpoint, objects, size, threads, etags) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=target, args=(endpoint, objects, size, threads, etags, out))
    process.start()
    result = out.get(timeout=600)
    process.join()
    return _rates(what, threads, objects, size, result)


def fetcher_get(config, objects: int, size: int, threads: int, etags: list[str]) -> dict:
    return _fetcher_get(config, objects, size, threads, etags, lean_s3=True)


def fetcher_boto3_get(config, objects: int, size: int, threads: int, etags: list[str]) -> dict:
    return _fetcher_get(config, objects, size, threads, etags, lean_s3=False)


def _fetcher_get(config, objects, size, threads, etags, *, lean_s3: bool) -> dict:
    from cachefs.cluster.fetchers import FetcherPool

    pool = FetcherPool(1, lean_s3=lean_s3)
    pool.fetch(config, key_of(0), 0, size, etags[0])  # start the process and its client
    pid = pool.pids()[0]
    errors: list[str] = []

    def getter(indices) -> None:
        for index in indices:
            try:
                pool.fetch(config, key_of(index), 0, size, etags[index])
            except Exception as exc:
                errors.append(str(exc)[:200])

    workers = [
        threading.Thread(target=getter, args=(range(t, objects, threads),)) for t in range(threads)
    ]
    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
    pool.close()
    result = {"seconds": seconds, "cpu_s": cpu, "errors": errors[:3], "error_count": len(errors)}
    client = "lean" if lean_s3 else "boto3"
    return _rates(f"fetcher process ({client})", threads, objects, size, result)


def _rates(what: str, threads: int, objects: int, size: int, result: dict) -> dict:
    return {
        "what": what,
        "in_flight": threads,
        "gets_per_s": objects / result["seconds"],
        "mb_per_s": objects * size / result["seconds"] / 1e6,
        "cpu_ms_per_get": 1000 * result["cpu_s"] / objects,
        **result,
    }


def preload(config, objects: int, processes: int, workdir: str, *, lean_s3: bool) -> dict:
    from cachefs.cache import TierConfig, TieredBlockCache
    from cachefs.cluster.fetchers import FetcherPool
    from cachefs.cluster.membership import Membership
    from cachefs.cluster.preload import Preloader
    from cachefs.meta import Snapshot, build_snapshot
    from cachefs.store import open_store

    workdir = tempfile.mkdtemp(prefix="preload-", dir=workdir)  # a fresh cache for each run
    store = open_store(config)
    listed = list(store.list())
    build_snapshot(iter(listed), os.path.join(workdir, "snapshot"))
    store.close()
    snapshot = Snapshot.open(os.path.join(workdir, "snapshot"))
    # The RAM tier on tmpfs, as a worker keeps it (--ram-dir): a disk filesystem would add its
    # own write costs to every admission.
    ram_dir = tempfile.mkdtemp(prefix="cachefs-bench-ram-", dir=RAM_PARENT)
    cache = TieredBlockCache(os.path.join(workdir, "index"), [TierConfig("ram", ram_dir, 2 << 30)])
    pool = FetcherPool(processes, lean_s3=lean_s3)

    # Every fetcher process started and its store client opened before the clock starts (one
    # 1-byte GET each, sent together so that each goes to another process): the other rows'
    # clients are made before theirs too, and a worker keeps its pool from its first preload.
    def pool_cpu() -> float:
        # The fetchers', and the forkserver's (their parent, which starts them; it may have
        # run for earlier rows too, so only differences count).
        return sum(cpu_seconds(pid) for pid in pool.pids()) + _forkserver_cpu()

    cpu_before = pool_cpu()
    started = time.perf_counter()
    warming = [pool.start(config, listed[0].key, 0, 1, listed[0].etag) for _ in range(processes)]
    for future in warming:
        future.result()
    start_s = time.perf_counter() - started
    cpu_at_start = pool_cpu()

    class Target:
        def preload_source(self, dataset):
            return snapshot, config, 1, 4 << 20

        async def prepare_reads(self, dataset, keys):
            return 0  # no mount here: nothing to prepare

    membership = Membership("n1")
    membership.update(
        {
            "cluster_id": "bench",
            "heartbeat_interval_s": 1.0,
            "nodes": {"n1": {"address": "127.0.0.2:1", "up": True}},
            "datasets": [{"spec": {"name": "ds"}, "refresh_epoch": 0, "copies": {"A": ["n1"]}}],
            "tasks": [],
        }
    )
    preloader = Preloader(Target(), cache, membership, pool)
    samples: list[int] = []

    async def run() -> float:
        async with trio.open_nursery() as nursery:
            await nursery.start(preloader.run)
            started = time.perf_counter()
            preloader.assign(
                [{"id": "ds-1", "dataset": "ds", "copy": "A", "selection": {}}],
                {"ds": {"A": ["n1"]}},
            )
            while True:
                # reports() walks every shard (a few ms of this process's CPU for 1,500
                # objects): only once every object was answered, not at every look.
                answered = preloader.fetched_blocks + preloader.fetch_failures >= objects
                shards = preloader.reports()["ds-1"] if answered else {}
                if len(shards) and all(r["complete"] for r in shards.values()):
                    break
                samples.append(preloader.concurrency.limit)
                await trio.sleep(0.05)
            seconds = time.perf_counter() - started
            nursery.cancel_scope.cancel()
        return seconds

    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = trio.run(run)
    after = resource.getrusage(resource.RUSAGE_SELF)
    worker_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    fetchers_cpu = pool_cpu() - cpu_at_start  # their start before the clock not included
    pool.close()
    cache.close()
    shutil.rmtree(ram_dir, ignore_errors=True)
    snapshot.close()
    report = preloader.concurrency.report()
    client = "lean client" if lean_s3 else "boto3"
    blocks = max(1, preloader.fetched_blocks)
    return {
        "what": f"cachefs preload ({processes} fetcher processes, {client}, adaptive)",
        "objects_per_s": preloader.fetched_blocks / seconds,
        "blocks": preloader.fetched_blocks,
        "failures": preloader.fetch_failures,
        "seconds": seconds,
        "concurrency": report,
        "concurrency_median": sorted(samples)[len(samples) // 2] if samples else None,
        # CPU per block: this process (the worker's part: preloader, pipes, admission) and
        # the fetcher processes (their start before the clock not included: below).
        "worker_cpu_ms_per_block": 1000 * worker_cpu / blocks,
        "fetchers_cpu_ms_per_block": 1000 * fetchers_cpu / blocks,
        # The pool's start (processes, imports, store clients): a worker's first preload.
        "fetchers_start_s": start_s,
        "fetchers_start_cpu_s": cpu_at_start - cpu_before,
    }


def make_objects(root: str, objects: int, size: int) -> None:
    os.makedirs(os.path.join(root, "obj"), exist_ok=True)
    chunk = os.urandom(size)
    for index in range(objects):
        with open(os.path.join(root, key_of(index)), "wb") as f:
            f.write(index.to_bytes(8, "big") + chunk[8:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store_fetch_rate", description=__doc__)
    parser.add_argument("--objects", type=int, default=1500)
    parser.add_argument("--size", default="110KB")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--threads", default="1,4,16,64")
    parser.add_argument("--processes", type=int, default=2, help="preload fetcher processes")
    parser.add_argument("--endpoint", help="an S3 endpoint already holding the objects")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated phases to skip: raw, lean, fetcher, fetcher-boto3, preload, "
        "preload-boto3",
    )
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    from bench.lean_s3 import LeanS3Process
    from cachefs.store import StoreConfig, open_store

    children: list = []
    with tempfile.TemporaryDirectory(prefix="fetch-rate-") as workdir:
        try:
            endpoint = args.endpoint
            if endpoint is None:
                make_objects(os.path.join(workdir, "root"), args.objects, size)
                server = LeanS3Process(os.path.join(workdir, "root"), BUCKET)
                children.append(server)
                endpoint = server.url
            if args.delay_ms:
                proxy = subprocess.Popen(
                    [sys.executable, "-m", "bench.delay_proxy", "--upstream", endpoint,
                     "--first-byte-ms", str(args.delay_ms), "--listen", "127.0.0.1:0"],
                    stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                children.append(proxy)
                line = proxy.stdout.readline()
                endpoint = next(w for w in line.split() if w.startswith("http://"))
            config = StoreConfig(f"s3://{BUCKET}/", endpoint=endpoint, dataset="bench")
            store = open_store(config)
            etags = {info.key: info.etag for info in store.list("obj/")}
            store.close()
            etag_list = [etags[key_of(i)] for i in range(args.objects)]
            results: dict = {"endpoint": endpoint, "delay_ms": args.delay_ms, "size": size}
            skip = set(args.skip.split(","))
            phases = (
                ("raw", raw_get, endpoint),
                ("lean", lean_get, endpoint),
                ("fetcher", fetcher_get, config),
                ("fetcher-boto3", fetcher_boto3_get, config),
            )
            for threads in [int(t) for t in args.threads.split(",")]:
                for name, measure, target in phases:
                    if name in skip:
                        continue
                    row = measure(target, args.objects, size, threads, etag_list)
                    results.setdefault(name, []).append(row)
                    print(
                        f"{row['what']:<28} {threads:>3} in flight: {row['gets_per_s']:7.0f} GET/s"
                        f"  {row['cpu_ms_per_get']:.2f} ms CPU/GET  errors {row['error_count']}",
                        flush=True,
                    )
            best = {
                name: max((r["gets_per_s"] for r in results.get(name, [])), default=0)
                for name in ("raw", "lean")
            }
            for name, lean_s3 in (("preload", True), ("preload-boto3", False)):
                if name in skip:
                    continue
                row = preload(config, args.objects, args.processes, workdir, lean_s3=lean_s3)
                results[name] = row
                ratios = ", ".join(
                    f"{row['objects_per_s'] / rate:.2f}x the best {label} rate"
                    for label, rate in (("raw boto3", best["raw"]), ("lean-client", best["lean"]))
                    if rate
                )
                print(
                    f"{row['what']}: {row['objects_per_s']:.0f} objects/s"
                    f"{' = ' + ratios if ratios else ''}; concurrency "
                    f"settled at {row['concurrency']['limit']} (median {row['concurrency_median']},"
                    f" peak {row['concurrency']['peak']}, throttled "
                    f"{row['concurrency']['throttled']}), failures {row['failures']}; CPU per "
                    f"block: worker {row['worker_cpu_ms_per_block']:.2f} ms, fetchers "
                    f"{row['fetchers_cpu_ms_per_block']:.2f} ms; the fetchers' start before it "
                    f"{row['fetchers_start_s']:.2f} s ({row['fetchers_start_cpu_s']:.2f} s CPU)",
                    flush=True,
                )
            print(json.dumps(results), file=sys.stderr)
        finally:
            for child in children:
                if isinstance(child, subprocess.Popen):
                    child.terminate()
                    child.wait(timeout=10)
                else:
                    child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
