"""``python -m bench all``: every data path, every workload, one run, one report.

The suite sets up one object store (moto behind the delay proxy: ``backend.py``), generates
the data once (``/dev/shm`` copies are the tmpfs data path; the same bytes are uploaded to the
store), and serves the store through every data path side by side:

* ``tmpfs``   — plain reads of the local copy: the physical limit of this machine;
* ``cachefs`` — a one-node cluster (coordinator + worker, so ``cachefs preload`` works);
* ``s3fs`` and ``rclone`` — mounted as their documentation recommends (``peers.py``);
* ``boto3``   — direct GETs through the proxy: the backend's raw capacity at each concurrency.

Workloads, in this order: small files (cold, after preload, warm; 1/4/16 readers), large
shards (sequential and strided, cold and warm), metadata (find/stat, worker RSS), the
training-input emulator on every path, thrash (avoid-eviction vs lru), multi-node
(``cluster_bench`` in a subprocess). Every read is verified (lengths always, content by hash).
``report.py`` turns the results into markdown and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from bench import emulator
from bench.cluster_bench import REPO, Cluster, git_head
from bench.datagen import (
    DatasetPlan,
    file_bytes,
    plan_dataset,
    size_summary,
    upload_s3,
    write_local,
)
from bench.read_bench import (
    MOTO_ENV,
    BenchmarkFailure,
    Setup,
    describe_machine,
    drop_page_cache,
    lock_workdir,
    read_pass,
    run_repeats,
    wait_for_quiet_cpu,
)
from bench.suite import large, metadata, peers, thrash
from bench.suite.backend import BUCKET, Backend
from bench.suite.presets import PRESETS, Preset

SYSTEMS = ("tmpfs", "cachefs", "s3fs", "rclone", "boto3")
#: Key prefixes in the bucket (and directories under the tmpfs copy); cachefs serves each as a
#: dataset of the same name, so key ``K`` is ``<root>/K`` on every mounted path.
SMALL, SAMPLES, LARGE, META = "small", "samples", "large", "meta"
METABIG = "metabig"  # the 1.28 M-entry namespace: a local file:// dataset of cachefs only
TARGET_READERS = 4
PRELOAD_TIMEOUT_S = 1800.0


@dataclass
class Context:
    """What the workloads share: the preset, where things are, the running systems."""

    args: argparse.Namespace
    preset: Preset
    workdir: str
    local_root: str  # the tmpfs copy: <local_root>/<prefix>/<key>
    backend: Backend | None = None
    cluster: Cluster | None = None
    mounts: dict[str, object] = field(default_factory=dict)  # s3fs, rclone
    plans: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def quiet(self) -> tuple[float, float]:
        return self.args.quiet_cpu, self.args.quiet_wait

    @property
    def cachefs_mount(self) -> str:
        assert self.cluster is not None
        return self.cluster.nodes[0].mount

    def root(self, system: str) -> str:
        """The directory in which object key ``prefix/K`` is the file ``prefix/K``."""
        if system == "tmpfs":
            return self.local_root
        if system == "cachefs":
            return self.cachefs_mount
        return self.mounts[system].root

    def systems(self) -> list[str]:
        return [s for s in SYSTEMS if s in ("tmpfs", "cachefs", "boto3") or s in self.mounts]


# --- set-up ----------------------------------------------------------------------------------


def generate_data(ctx: Context) -> None:
    """Write the local copies (skipped when already complete) and the plans."""
    p = ctx.preset
    small = plan_dataset(p.small_files, seed=ctx.args.seed)
    samples = emulator.plan_samples(p.samples, seed=ctx.args.seed)
    shards = large.plan_shards(p.shards, min_size=p.shard_min, max_size=p.shard_max)
    ctx.plans.update(small=small, samples=samples, shards=shards)
    log(f"generating data under {ctx.local_root}")
    write_local(os.path.join(ctx.local_root, SMALL), small, threads=4)
    write_local(os.path.join(ctx.local_root, SAMPLES), samples, threads=4)
    large.write_local(os.path.join(ctx.local_root, LARGE), shards, seed=0)
    meta_root = os.path.join(ctx.local_root, METABIG)
    created = metadata.make_local_namespace(meta_root, p.meta_entries)
    log(f"  namespace of {p.meta_entries:,} entries ({created:,} created)")


def upload_data(ctx: Context) -> dict:
    backend = ctx.backend
    client = backend.upload_client
    began = time.monotonic()
    log("uploading to the store")
    upload_s3(client, BUCKET, f"{SMALL}/", ctx.plans["small"], threads=8)
    upload_s3(client, BUCKET, f"{SAMPLES}/", ctx.plans["samples"], threads=8)
    large.upload_s3(client, BUCKET, f"{LARGE}/", ctx.plans["shards"], seed=0)
    metadata.upload_namespace(client, BUCKET, f"{META}/", ctx.preset.meta_peer_entries)
    return {"seconds": round(time.monotonic() - began, 1)}


def dataset_spec(ctx: Context, name: str) -> dict:
    if name == METABIG:
        return {"name": name, "uri": f"file://{os.path.join(ctx.local_root, METABIG)}"}
    return {
        "name": name,
        "uri": f"s3://{BUCKET}/{name}",
        "endpoint": ctx.backend.endpoint,
        "region": MOTO_ENV["AWS_DEFAULT_REGION"],
        "path_style": True,
    }


def start_cachefs(ctx: Context, stack: contextlib.ExitStack) -> None:
    """A one-node cluster on 127.0.0.2; RAM tier big enough for every dataset. Its stop is
    registered on ``stack`` before it starts, so a failed start leaves nothing running."""
    p = ctx.preset
    data = ctx.plans["small"].total_bytes + ctx.plans["samples"].total_bytes
    data += sum(s.size for s in ctx.plans["shards"])
    ram_mib = max(1024, int(1.25 * data) >> 20)
    options = argparse.Namespace(
        nodes=1, preload_processes=ctx.args.preload_processes, worker_args=ctx.args.cachefs_args
    )
    workdir = os.path.join(ctx.workdir, "cachefs")
    shutil.rmtree(workdir, ignore_errors=True)  # a cold cache and an empty coordinator
    os.makedirs(workdir)
    ctx.cluster = Cluster(workdir, options, f"{ram_mib}MiB")
    stack.callback(ctx.cluster.stop)
    ctx.cluster.start()
    for name in (SMALL, SAMPLES, LARGE, META):
        ctx.cluster.add_dataset(dataset_spec(ctx, name))
    log(f"cachefs: 1 node, RAM tier {ram_mib} MiB, mount {ctx.cachefs_mount} ({p.name})")


def start_peers(ctx: Context) -> None:
    missing = [name for name, why in peers.available().items() if why]
    for name in missing:
        ctx.notes.append(f"{name} is not installed: {peers.available()[name]}; its rows are empty")
    cache_size = 4 * (
        ctx.plans["small"].total_bytes
        + ctx.plans["samples"].total_bytes
        + sum(s.size for s in ctx.plans["shards"])
    )
    for name, cls in (("s3fs", peers.S3fsMount), ("rclone", peers.RcloneMount)):
        if name in missing or name in ctx.args.skip:
            continue
        mount = cls(
            ctx.backend.endpoint,
            BUCKET,
            os.path.join(ctx.workdir, name),
            env=MOTO_ENV,
            cache_size=cache_size,
        )
        mount.start()
        ctx.mounts[name] = mount
        log(f"{name}: mounted at {mount.root}")


# --- making a data path cold -----------------------------------------------------------------


def cachefs_fresh_dataset(ctx: Context, name: str) -> None:
    """Remove the dataset (its blocks go with it) and add it again: nothing cached."""
    ctx.cluster.client.remove_dataset(name)
    node = ctx.cluster.nodes[0]
    path = os.path.join(node.mount, name)
    deadline = time.monotonic() + 60
    while os.path.isdir(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    ctx.cluster.add_dataset(dataset_spec(ctx, name))
    cached = next(d for d in node.client.datasets() if d["name"] == name)["cached_bytes"]
    if cached:
        raise BenchmarkFailure(f"cachefs: {name} re-added with {cached} bytes cached")


def make_cold(ctx: Context, system: str, prefix: str) -> Callable[[], None]:
    """A function that makes the next reads of ``prefix`` on ``system`` reach the store."""

    def cold() -> None:
        if system == "cachefs":
            cachefs_fresh_dataset(ctx, prefix)
        elif system in ctx.mounts:
            ctx.mounts[system].drop_cache()
        drop_page_cache()

    return cold


def cachefs_preload(ctx: Context, name: str) -> dict:
    """``cachefs preload NAME`` (100 %), polled until it ends; must complete without failures."""
    client = ctx.cluster.client
    began = time.monotonic()
    client.preload(name)
    while True:
        job = client.preload_status(name)
        if job["state"] not in ("running", "scheduled"):
            break
        if time.monotonic() - began > PRELOAD_TIMEOUT_S:
            raise BenchmarkFailure(f"preload of {name} still {job['state']} after the timeout")
        ctx.cluster.check_alive()
        time.sleep(0.25)
    seconds = time.monotonic() - began
    if job["state"] != "completed" or job["failed_count"]:
        raise BenchmarkFailure(f"preload of {name} ended {job['state']}: {job['failed'][:5]}")
    return {
        "objects": job["objects_done"],
        "bytes": job["bytes_done"],
        "seconds": round(seconds, 2),
        "objects_per_s": job["objects_done"] / seconds,
        "mb_per_s": job["bytes_done"] / seconds / 1e6,
    }


class ProxyCounters:
    """What ``run_repeats`` asks a worker for, answered by the proxy: object GETs that reached
    the store during a pass (for every data path, not only cachefs)."""

    def __init__(self, backend: Backend, cluster: Cluster | None):
        self.backend, self.cluster = backend, cluster

    def counters(self) -> dict[str, int]:
        return {"store_gets": self.backend.stats()["object_gets"]}

    def check_alive(self) -> None:
        if self.cluster is not None:
            self.cluster.check_alive()


# --- small files -----------------------------------------------------------------------------


def small_files(ctx: Context) -> dict:
    plan: DatasetPlan = ctx.plans["small"]
    order = list(range(len(plan.files)))
    random.Random(ctx.args.order_seed).shuffle(order)
    sample = random.Random(ctx.args.order_seed + 1).sample(order, min(200, len(order)))
    sha = {i: hashlib.sha256(file_bytes(plan.files[i], plan.seed)).hexdigest() for i in sample}
    p = ctx.preset
    quiet = dict(quiet_cpu=ctx.args.quiet_cpu, quiet_wait_s=ctx.args.quiet_wait)
    warm_setup = Setup(plan, order, sha, list(p.readers), p.repeats, **quiet)
    cold_order = order[: p.cold_files]
    cold_setup = Setup(plan, cold_order, sha, list(p.readers), 1, **quiet)
    counters = ProxyCounters(ctx.backend, ctx.cluster)
    passes: list[dict] = []
    preload: dict | None = None

    def run(name, setup, system, before_each, **kwargs) -> None:
        results = run_repeats(setup, name, kwargs.pop("paths"), before_each=before_each,
                              worker=counters, **kwargs)  # fmt: skip
        passes.extend({"system": system, **asdict(r)} for r in results)

    for system in ctx.systems():
        log(f"small files: {system}")
        if system == "boto3":
            client = ctx.backend.client(pool=max(p.readers) + 4)
            keys = [f"{SMALL}/{spec.path}" for spec in plan.files]

            def get(key: str, client=client) -> bytes:
                return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

            run("cold", cold_setup, system, lambda: None, paths=keys, read_file=get)
            continue
        root = os.path.join(ctx.root(system), SMALL)
        paths = [os.path.join(root, spec.path) for spec in plan.files]
        if system != "tmpfs":
            run("cold", cold_setup, system, make_cold(ctx, system, SMALL), paths=paths)
        if system == "cachefs":
            cachefs_fresh_dataset(ctx, SMALL)
            preload = cachefs_preload(ctx, SMALL)
            run("after_preload", warm_setup, system, drop_page_cache, paths=paths)

        # s3fs asks the store (a HEAD, 20 ms) on every open even when the data is in its disk
        # cache, and rclone serves every read from its disk cache through FUSE: a warm pass of
        # the whole set would take them tens of minutes, so they read the cold subset, once.
        setup = cold_setup if system in ctx.mounts else warm_setup

        def warm_up(paths=paths, setup=setup) -> None:
            sizes = [spec.size for spec in plan.files]
            read_pass(paths, sizes, setup.order, max(p.readers), sha)

        run("warm", setup, system, warm_up, paths=paths)
    return {
        "files": len(plan.files),
        "bytes": plan.total_bytes,
        "sizes": size_summary(spec.size for spec in plan.files),
        "cold_files": len(cold_order),
        "passes": passes,
        "preload": preload,
    }


# --- large files -----------------------------------------------------------------------------


def large_files(ctx: Context) -> dict:
    shards = ctx.plans["shards"]
    digests = large.shard_digests(shards, seed=0)
    runs: list[dict] = []
    patterns = (("sequential", 1), ("sequential", TARGET_READERS), ("strided", TARGET_READERS))
    for system in ctx.systems():
        log(f"large files: {system}")
        if system == "boto3":
            reader = large.S3Reader(ctx.backend.client(pool=16), BUCKET, f"{LARGE}/")
        else:
            reader = large.DirReader(os.path.join(ctx.root(system), LARGE))
        states = ("warm",) if system == "tmpfs" else ("cold",) if system == "boto3" else (
            "cold", "warm")  # fmt: skip
        for pattern, readers in patterns:
            # boto3 reads a sequential shard in big ranges (as a tuned client would); strided
            # reads are 1 MiB every 8 MiB on every path.
            io_size = (
                ctx.args.s3_range if (system, pattern) == ("boto3", "sequential") else large.CHUNK
            )
            for state in states:
                if state == "cold" and system != "boto3":
                    make_cold(ctx, system, LARGE)()
                elif state == "warm" and system != "tmpfs":
                    # One untimed read, so the data path holds what this pattern reads.
                    large.measure(reader, shards, digests, pattern=pattern, readers=readers,
                                  io_size=io_size)  # fmt: skip
                wait_for_quiet_cpu(*ctx.quiet)
                before = ctx.backend.stats()
                result = large.measure(
                    reader, shards, digests, pattern=pattern, readers=readers, io_size=io_size
                )
                result.update(
                    system=system,
                    state=state,
                    store_gets=Backend.object_gets(before, ctx.backend.stats()),
                )
                mb_s = result["mb_per_s"]
                log(f"  {pattern:<10} {readers:>2} readers {state:<4} {mb_s:8.1f} MB/s")
                runs.append(result)
    return {
        "shards": [asdict(s) for s in shards],
        "bytes": sum(s.size for s in shards),
        "s3_range_bytes": ctx.args.s3_range,
        "runs": runs,
    }


# --- metadata --------------------------------------------------------------------------------


def metadata_workload(ctx: Context) -> dict:
    """The big namespace on tmpfs and cachefs (a file:// dataset: listing it is the dataset
    add), then the smaller S3 namespace on every mounted path."""
    p = ctx.preset
    node = ctx.cluster.nodes[0]
    worker_pid = node.process.pid
    out: dict = {"entries": p.meta_entries, "peer_entries": p.meta_peer_entries}
    big_root = os.path.join(ctx.local_root, METABIG)
    expected = metadata.expected_counts(p.meta_entries)
    log(f"metadata: tmpfs, {p.meta_entries:,} entries")
    out["tmpfs"] = metadata.measure_namespace(big_root, *expected)
    out["rss_before_add"] = metadata.process_rss(worker_pid)
    began = time.monotonic()
    ctx.cluster.add_dataset(dataset_spec(ctx, METABIG))
    out["cachefs_add_s"] = round(time.monotonic() - began, 2)
    out["rss_after_add"] = metadata.process_rss(worker_pid)
    log(f"metadata: cachefs, {p.meta_entries:,} entries (added in {out['cachefs_add_s']} s)")
    out["cachefs"] = metadata.measure_namespace(os.path.join(ctx.cachefs_mount, METABIG), *expected)
    out["rss_after_walk"] = metadata.process_rss(worker_pid)
    ctx.cluster.client.remove_dataset(METABIG)
    peer_expected = metadata.expected_counts(p.meta_peer_entries)
    out["peers"] = {}
    for system in ctx.systems():
        if system in ("tmpfs", "boto3"):
            continue
        log(f"metadata: {system}, {p.meta_peer_entries:,} entries from the store")
        if system in ctx.mounts:
            ctx.mounts[system].drop_cache()
        root = os.path.join(ctx.root(system), META)
        out["peers"][system] = metadata.measure_namespace(root, *peer_expected)
    return out


# --- emulator --------------------------------------------------------------------------------


def emulator_workload(ctx: Context) -> dict:
    """The emulator's search on every data path. Paths with a cache read every sample once
    right before each trial (an epoch of training has passed; done after the quiet-CPU wait,
    since this machine reclaims page cache left idle for a minute); cachefs also runs with the
    page cache dropped before each trial, so every sample comes from its RAM tier through
    FUSE."""
    p = ctx.preset
    runs: dict[str, dict] = {}
    variants = []
    for system in ctx.systems():
        if system == "boto3":
            data = f"s3:{ctx.backend.endpoint}/{BUCKET}/{SAMPLES}"
            variants.append((system, data, []))
            continue
        data = f"dir:{os.path.join(ctx.root(system), SAMPLES)}"
        variants.append((system, data, ["--warm-up"]))
        if system == "cachefs":
            variants.append(("cachefs_ram_tier", data, ["--drop-caches"]))
            # As a training job reads: it lists the dataset, then reads (dentries kept).
            variants.append(("cachefs_ram_tier_listed", data, ["--drop-pages"]))
    for name, data, extra in variants:
        log(f"emulator: {name}")
        argv = [
            "--data", data, "--samples", str(p.samples), "--scale", str(p.emulator_scale),
            "--batches", str(p.emulator_batches), "--max-accelerators", str(p.emulator_max),
            "--quiet-cpu", str(ctx.args.quiet_cpu), "--quiet-wait", str(ctx.args.quiet_wait),
            "--seed", str(ctx.args.seed), *extra,
        ]  # fmt: skip
        args = emulator.build_parser().parse_args(argv)
        args.argv = argv
        runs[name] = emulator.run_benchmark(args)
    return runs


# --- thrash and multi-node -------------------------------------------------------------------


def thrash_workload(ctx: Context) -> dict:
    plan = ctx.plans["small"]
    cache_bytes = plan.total_bytes // 2
    results = {}
    for policy in ("avoid-eviction", "lru"):
        log(f"thrash: {policy}, cache {cache_bytes >> 20} MiB for {plan.total_bytes >> 20} MiB")
        results[policy] = thrash.measure_thrash(
            plan=plan,
            dataset_spec=dataset_spec(ctx, SMALL),
            env=MOTO_ENV,
            workdir=os.path.join(ctx.workdir, f"thrash-{policy}"),
            admission=policy,
            cache_bytes=cache_bytes,
            epochs=3,
            readers=TARGET_READERS,
            order_seed=ctx.args.order_seed,
        )
    return {"policies": results, "targets": thrash.evaluate_thrash(results)}


def multi_node(ctx: Context) -> dict | None:
    """bench.cluster_bench in a subprocess (its own moto, three workers on 127.0.0.2-4)."""
    files = ctx.preset.cluster_files
    if not files or "multinode" in ctx.args.skip:
        return None
    out = os.path.join(ctx.workdir, "cluster_bench.json")
    argv = [
        sys.executable, "-m", "bench.cluster_bench", "--files", str(files), "--nodes", "3",
        "--threads", str(TARGET_READERS), "--json", out,
        "--workdir", os.path.join(ctx.workdir, "cluster-bench"),
        "--quiet-cpu", str(ctx.args.quiet_cpu), "--quiet-wait", str(ctx.args.quiet_wait),
    ]  # fmt: skip
    log(f"multi-node: {' '.join(argv[1:])}")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchmarkFailure(f"cluster_bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as results:
        return json.load(results)


# --- the run ---------------------------------------------------------------------------------


WORKLOADS: dict[str, Callable[[Context], object]] = {
    "small": small_files,
    "large": large_files,
    "metadata": metadata_workload,
    "emulator": emulator_workload,
    "thrash": thrash_workload,
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_suite(args: argparse.Namespace) -> dict:
    preset = PRESETS[args.preset]
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    with lock_workdir(workdir, "suite"):
        ctx = Context(args, preset, workdir, local_root=args.local_root)
        started = time.time()
        load_before = list(os.getloadavg())
        results: dict = {}
        generate_data(ctx)
        with contextlib.ExitStack() as stack:
            ctx.backend = Backend(os.path.join(workdir, "backend"), delay_ms=args.first_byte_ms,
                                  bandwidth=args.bandwidth)  # fmt: skip
            stack.callback(ctx.backend.stop)
            results["upload"] = upload_data(ctx)
            start_cachefs(ctx, stack)
            stack.callback(lambda: [m.stop() for m in ctx.mounts.values()])
            start_peers(ctx)
            for name, workload in WORKLOADS.items():
                if name in args.skip:
                    continue
                began = time.monotonic()
                results[name] = workload(ctx)
                results.setdefault("durations_s", {})[name] = round(time.monotonic() - began, 1)
            describe = {
                "backend": ctx.backend.describe(),
                "cachefs": {"argv": ctx.cluster.nodes[0].argv, "extra": args.cachefs_args},
                **{name: mount.describe() for name, mount in ctx.mounts.items()},
            }
        results["multinode"] = multi_node(ctx)
        return {
            "benchmark": "suite",
            "preset": asdict(preset),
            "date": datetime.date.today().isoformat(),
            "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1),
            "command": exact_command(args.argv),
            "git": git_head(),
            "machine": describe_machine(),
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
            "systems": describe,
            "notes": ctx.notes,
            **results,
        }


def exact_command(argv: Sequence[str]) -> str:
    import shlex

    inside = sys.executable.startswith(os.getcwd() + os.sep)
    interpreter = os.path.relpath(sys.executable) if inside else sys.executable
    return shlex.join([interpreter, "-m", "bench", "all", *argv])
