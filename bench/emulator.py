"""Training-input emulator: how many accelerators can a data path keep busy?

    python -m bench.emulator generate dir:/dev/shm/samples --samples 10000
    python -m bench.emulator --data dir:/dev/shm/samples --samples 10000 --scale 0.1
    python -m bench.emulator --data s3:http://127.0.0.1:5000/bucket/samples --accelerators 1,2,4

N emulated accelerators each consume batches of samples, as MLPerf Storage's ResNet-50 workload
does (by default 114,660-byte samples, 400 per batch, 0.224 s of compute per batch). Each
accelerator has its own pool of ``--readers`` threads that read its samples, one file per
sample, in a shuffled order; it "computes" (sleeps) a batch only once every sample of that batch
has been read, and its readers may work ``--prefetch`` batches ahead of the batch it computes.
Accelerator utilisation = compute time / wall time. The emulator measures it at several N and
searches for the largest N whose mean utilisation is at least ``--target`` (0.9): N doubles
until a trial falls short, then the gap is bisected (at most ``--max-accelerators``).

Data paths: ``dir:PATH`` (any directory: tmpfs, a cachefs mount, an s3fs or rclone mount) and
``s3:ENDPOINT/BUCKET/PREFIX`` (boto3 GETs of whole objects with the bench's moto credentials,
``MOTO_ENV`` of read_bench). The samples are made by ``generate`` (or ``--generate``): class
directories of equal-sized files, with datagen's names and bytes, so every sample's length and
xxh3 is checked against the generator; a wrong byte aborts the run.

Output: JSON (stdout or ``--json``) and a markdown table; ``--save-dir`` writes both as
``<dir>/<YYYY-MM-DD>.json|md``. Nothing here is imported by cachefs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import os
import queue
import random
import shlex
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import xxhash

from bench.cluster_bench import busy_between, cpu_ticks, expected_hashes, git_head, s3_client
from bench.datagen import MIN_SIZE, DatasetPlan, plan_dataset, upload_s3, write_local
from bench.read_bench import (
    BenchmarkFailure,
    describe_machine,
    drop_page_cache,
    read_whole_file,
    run_and_report,
    wait_for_quiet_cpu,
)
from cachefs.units import parse_duration

#: MLPerf Storage's ResNet-50 workload: bytes per sample, samples per batch, compute per batch.
SAMPLE_SIZE = 114_660
BATCH = 400
COMPUTE_S = 0.224
TARGET_UTILISATION = 0.9
#: How often a waiting reader or accelerator looks at the abort flag.
POLL_S = 0.1


# --- the samples -----------------------------------------------------------------------------


def plan_samples(
    samples: int, *, sample_size: int = SAMPLE_SIZE, classes: int = 100, seed: int = 0
) -> DatasetPlan:
    """``samples`` files of exactly ``sample_size`` bytes under datagen's class directories
    (same paths as ``plan_dataset``), bytes from ``datagen.file_bytes``: a pure function of
    the arguments."""
    if sample_size < MIN_SIZE:
        raise ValueError(f"sample_size must be at least {MIN_SIZE} bytes, got {sample_size}")
    layout = plan_dataset(samples, classes=classes, seed=seed)
    return DatasetPlan(tuple(replace(spec, size=sample_size) for spec in layout.files), seed)


@dataclass(frozen=True)
class DataPath:
    """Where the samples are read from: a directory, or an S3 endpoint, bucket and prefix."""

    kind: str  # "dir" or "s3"
    location: str  # the directory, or the endpoint URL
    bucket: str = ""
    prefix: str = ""  # "" or ending in "/"

    def __str__(self) -> str:
        if self.kind == "dir":
            return f"dir:{self.location}"
        return f"s3:{self.location}/{self.bucket}/{self.prefix}"

    def opener(self, threads: int) -> Callable[[str], bytes]:
        """A function from a sample's path (relative to the dataset) to its bytes, safe to
        call from ``threads`` threads at once (one boto3 client with that many connections)."""
        if self.kind == "dir":
            root = self.location
            return lambda key: read_whole_file(os.path.join(root, key))
        client = s3_client(self.location, pool=max(10, threads))
        bucket, prefix = self.bucket, self.prefix
        return lambda key: client.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()


def parse_data_path(text: str) -> DataPath:
    """``dir:PATH`` or ``s3:http(s)://host:port/bucket[/prefix]``."""
    kind, _, rest = text.partition(":")
    if kind == "dir" and rest:
        return DataPath("dir", os.path.abspath(rest))
    if kind == "s3":
        split = urllib.parse.urlsplit(rest)
        bucket, _, prefix = split.path.lstrip("/").partition("/")
        if split.scheme in ("http", "https") and split.netloc and bucket:
            prefix = prefix.strip("/")
            return DataPath(
                "s3", f"{split.scheme}://{split.netloc}", bucket, f"{prefix}/" if prefix else ""
            )
    raise ValueError(
        f"data path {text!r}: write dir:/some/directory or s3:http://host:port/bucket/prefix"
    )


def filesystem_of(path: str, mounts_text: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (``tmpfs``, ``fuse.cachefs``...), from the
    longest mount point in /proc/self/mounts that contains it."""
    if mounts_text is None:
        with open("/proc/self/mounts") as mounts:
            mounts_text = mounts.read()
    path = os.path.abspath(path)
    best, fstype = "", "unknown"
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def generate(data_path: DataPath, plan: DatasetPlan, threads: int = 8) -> str:
    """Write (dir) or upload (s3; the bucket is created if missing) every sample of ``plan``;
    return a one-line summary. Files already there with the right size are kept."""
    if data_path.kind == "dir":
        written = write_local(data_path.location, plan, threads=threads)
        return f"{data_path}: {len(plan.files):,} samples ({written:,} written)"
    client = s3_client(data_path.location, pool=max(10, threads))
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if data_path.bucket not in existing:
        client.create_bucket(Bucket=data_path.bucket)
    sent = upload_s3(client, data_path.bucket, data_path.prefix, plan, threads=threads)
    return f"{data_path}: {len(plan.files):,} samples uploaded ({sent:,} bytes)"


# --- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What every accelerator does in one trial."""

    batch: int  # samples per batch
    compute_s: float  # emulated compute per batch
    batches: int  # batches per accelerator per trial
    readers: int  # reader threads per accelerator
    prefetch: int  # batches the readers may read ahead of the one being computed

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batches < 1 or self.readers < 1 or self.prefetch < 0:
            raise ValueError(f"invalid workload {self}")
        if self.compute_s < 0:
            raise ValueError(f"compute must be >= 0, got {self.compute_s}")

    @classmethod
    def scaled(
        cls,
        batch: int,
        compute_s: float,
        scale: float,
        *,
        batches: int,
        readers: int,
        prefetch: int,
    ) -> Workload:
        """Batch and compute shrunk by ``scale`` (batch rounded, at least 1; compute in
        proportion to the rounded batch), so an accelerator still wants the same samples/s."""
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        scaled_batch = max(1, round(batch * scale))
        compute = compute_s if scaled_batch == batch else compute_s * scaled_batch / batch
        return cls(scaled_batch, compute, batches, readers, prefetch)

    @property
    def samples_per_accelerator(self) -> int:
        return self.batch * self.batches

    @property
    def demand_samples_per_s(self) -> float:
        """Samples/s one accelerator consumes when it never waits."""
        return self.batch / self.compute_s if self.compute_s else float("inf")


def epoch_order(samples: int, epoch: int, seed: int) -> list[int]:
    order = list(range(samples))
    random.Random(f"cachefs-emulator-order/{seed}/{epoch}").shuffle(order)
    return order


def accelerator_streams(samples: int, accelerators: int, each: int, seed: int) -> list[list[int]]:
    """The sample indices each accelerator reads, in order. The global order is one shuffled
    permutation of the samples per epoch, epochs one after another; accelerator ``a`` takes
    every N-th position from ``a`` on (as PyTorch's DistributedSampler), ``each`` of them."""
    needed = accelerators * each
    order: list[int] = []
    epoch = 0
    while len(order) < needed:
        order += epoch_order(samples, epoch, seed)
        epoch += 1
    return [order[a::accelerators][:each] for a in range(accelerators)]


def utilisation(compute_s: float, wall_s: float) -> float:
    """compute / wall, within [0, 1] (0 for an empty run)."""
    if wall_s <= 0:
        return 0.0
    return max(0.0, min(1.0, compute_s / wall_s))


# --- one accelerator -------------------------------------------------------------------------


@dataclass
class AcceleratorResult:
    index: int
    samples: int = 0
    bytes: int = 0
    batches: int = 0
    compute_s: float = 0.0  # nominal compute of the batches run
    wait_s: float = 0.0  # waiting for batches' samples
    first_wait_s: float = 0.0  # ...of which for the first batch (nothing to overlap it with)
    started: float = 0.0  # time.monotonic(), comparable between processes
    finished: float = 0.0
    error: str = ""

    @property
    def wall_s(self) -> float:
        return self.finished - self.started

    @property
    def utilisation(self) -> float:
        return utilisation(self.compute_s, self.wall_s)

    def steady_utilisation(self, compute_per_batch: float) -> float | None:
        """Utilisation after the first batch: leaves out the first wait and first compute,
        which nothing can overlap. None with fewer than two batches."""
        if self.batches < 2:
            return None
        return utilisation(
            self.compute_s - compute_per_batch,
            self.wall_s - self.first_wait_s - compute_per_batch,
        )


class _Batches:
    """What one accelerator and its readers share: which sample to read next, how many of each
    batch are done, and which batch the accelerator is at."""

    def __init__(self, workload: Workload, abort) -> None:
        self.cond = threading.Condition()
        self.batch = workload.batch
        self.prefetch = workload.prefetch
        self.total = workload.samples_per_accelerator
        self.done = [0] * workload.batches
        self.next = 0  # the next position of the stream to hand to a reader
        self.current = 0  # the batch the accelerator waits for or computes
        self.abort = abort

    def take(self) -> int | None:
        """The next position to read, once it is within the prefetch window; None when there
        is nothing left or the run is aborted."""
        with self.cond:
            while True:
                if self.abort.is_set() or self.next >= self.total:
                    return None
                if self.next // self.batch <= self.current + self.prefetch:
                    self.next += 1
                    return self.next - 1
                self.cond.wait(POLL_S)

    def complete(self, position: int) -> None:
        with self.cond:
            batch = position // self.batch
            self.done[batch] += 1
            if self.done[batch] == self.batch:
                self.cond.notify_all()

    def wait_for(self, batch: int) -> bool:
        """Move the accelerator to ``batch`` (the readers may now go further) and wait until
        all of its samples are read; False when the run is aborted."""
        with self.cond:
            self.current = batch
            self.cond.notify_all()
            while self.done[batch] < self.batch:
                if self.abort.is_set():
                    return False
                self.cond.wait(POLL_S)
            return True


@dataclass(frozen=True)
class Samples:
    """The dataset as the readers check it: path, length and xxh3_64 of every sample."""

    keys: Sequence[str]
    sizes: Sequence[int]
    hashes: Sequence[int]

    @classmethod
    def of(cls, plan: DatasetPlan) -> Samples:
        return cls(
            [spec.path for spec in plan.files],
            [spec.size for spec in plan.files],
            expected_hashes(plan),
        )

    def check(self, index: int, data: bytes) -> None:
        if len(data) != self.sizes[index]:
            raise BenchmarkFailure(
                f"{self.keys[index]}: read {len(data)} bytes, expected {self.sizes[index]}"
            )
        if xxhash.xxh3_64_intdigest(data) != self.hashes[index]:
            raise BenchmarkFailure(f"{self.keys[index]}: content differs from the source (xxh3)")


def run_accelerator(
    index: int,
    data_path: DataPath,
    samples: Samples,
    stream: Sequence[int],
    workload: Workload,
    start,
    abort,
) -> AcceleratorResult:
    """One accelerator: set up its readers, wait at ``start`` (a barrier shared by all
    accelerators of the trial), then compute each batch once its samples are read. ``abort``
    (an Event) stops everything; a reader that reads a wrong byte sets it."""
    result = AcceleratorResult(index)
    state = _Batches(workload, abort)
    lock = threading.Lock()
    go = threading.Event()
    errors: list[str] = []

    def reader(read: Callable[[str], bytes]) -> None:
        go.wait()
        try:
            while (position := state.take()) is not None:
                sample = stream[position]
                data = read(samples.keys[sample])
                samples.check(sample, data)
                with lock:
                    result.samples += 1
                    result.bytes += len(data)
                state.complete(position)
        except Exception as exc:  # reported with the trial, and stops the others
            errors.append(f"accelerator {index}: {type(exc).__name__}: {exc}")
            abort.set()

    try:
        read = data_path.opener(workload.readers)
    except BaseException:
        abort.set()
        start.abort()  # the others must not wait for this one at the barrier
        raise
    threads = [
        threading.Thread(target=reader, args=(read,), daemon=True) for _ in range(workload.readers)
    ]
    for thread in threads:
        thread.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        abort.set()
        errors.append(f"accelerator {index}: the others did not start")
    result.started = time.monotonic()
    go.set()
    for batch in range(workload.batches):
        waited = time.monotonic()
        if not state.wait_for(batch):
            break
        waited = time.monotonic() - waited
        result.wait_s += waited
        if batch == 0:
            result.first_wait_s = waited
        if workload.compute_s:
            time.sleep(workload.compute_s)
        result.compute_s += workload.compute_s
        result.batches += 1
    result.finished = time.monotonic()
    for thread in threads:
        thread.join()
    if errors:
        result.error = errors[0]
    elif result.batches < workload.batches:
        result.error = f"accelerator {index}: aborted after {result.batches} batches"
    return result


def _accelerator_process(results: multiprocessing.Queue, *args) -> None:
    try:
        results.put(asdict(run_accelerator(*args)))
    except BaseException as exc:  # the parent must hear about it, whatever it was
        results.put({"index": args[0], "error": f"{type(exc).__name__}: {exc}"})


def run_trial(
    data_path: DataPath,
    samples: Samples,
    accelerators: int,
    workload: Workload,
    *,
    order_seed: int,
    mode: str = "process",
    timeout: float = 600.0,
) -> list[AcceleratorResult]:
    """Run ``accelerators`` accelerators at once: each in its own process (``mode="process"``,
    forked, like one training process per accelerator) or all in threads of this process
    (``"thread"``: cheap, for tests). BenchmarkFailure if any of them failed."""
    streams = accelerator_streams(
        len(samples.keys), accelerators, workload.samples_per_accelerator, order_seed
    )
    if mode == "thread":
        results = _run_threads(data_path, samples, streams, workload, timeout)
    elif mode == "process":
        results = _run_processes(data_path, samples, streams, workload, timeout)
    else:
        raise ValueError(f"mode must be process or thread, got {mode!r}")
    errors = [r.error for r in results if r.error]
    if errors:
        # The first reader error, not an accelerator that merely stopped because of it.
        errors.sort(key=lambda e: "aborted after" in e or "did not start" in e)
        raise BenchmarkFailure(f"{len(errors)} accelerator(s) failed; first: {errors[0]}")
    return results


def _run_threads(data_path, samples, streams, workload, timeout) -> list[AcceleratorResult]:
    start = threading.Barrier(len(streams), timeout=timeout)
    abort = threading.Event()
    results: list[AcceleratorResult | None] = [None] * len(streams)

    def accelerator(a: int) -> None:
        try:
            results[a] = run_accelerator(a, data_path, samples, streams[a], workload, start, abort)
        except Exception as exc:
            abort.set()
            results[a] = AcceleratorResult(a, error=f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=accelerator, args=(a,)) for a in range(len(streams))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        abort.set()
        start.abort()
        for thread in threads:
            thread.join(30)
        raise BenchmarkFailure(f"the trial did not finish in {timeout:.0f}s")
    return [
        r if r is not None else AcceleratorResult(a, error="no result")
        for a, r in enumerate(results)
    ]


def _run_processes(data_path, samples, streams, workload, timeout) -> list[AcceleratorResult]:
    context = multiprocessing.get_context("fork")  # the children inherit the sample table
    start = context.Barrier(len(streams), timeout=timeout)
    abort = context.Event()
    answers = context.Queue()
    processes = [
        context.Process(
            target=_accelerator_process,
            args=(answers, a, data_path, samples, streams[a], workload, start, abort),
            daemon=True,
        )
        for a in range(len(streams))
    ]
    got: dict[int, dict] = {}
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        while len(got) < len(processes):
            try:
                answer = answers.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    abort.set()
                    why = f"exit code {dead[0].exitcode}" if dead else f"not done in {timeout}s"
                    raise BenchmarkFailure(f"an accelerator process failed: {why}") from None
                continue
            got[answer["index"]] = answer
            if answer.get("error"):
                abort.set()
        for process in processes:
            process.join(30)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(10)
        answers.close()
    return [AcceleratorResult(**got[a]) for a in range(len(processes))]


# --- trials and the search -------------------------------------------------------------------


def summarise_trial(
    accelerators: int, results: Sequence[AcceleratorResult], workload: Workload, dataset: int
) -> dict:
    """The numbers of one trial (a dict as in the JSON)."""
    seconds = max(r.finished for r in results) - min(r.started for r in results)
    utils = [r.utilisation for r in results]
    steady = [r.steady_utilisation(workload.compute_s) for r in results]
    samples = sum(r.samples for r in results)
    nbytes = sum(r.bytes for r in results)
    return {
        "accelerators": accelerators,
        "mean_utilisation": sum(utils) / len(utils),
        "min_utilisation": min(utils),
        "utilisation": [round(u, 4) for u in utils],
        "mean_steady_utilisation": _mean_or_none(steady),
        "mean_first_batch_wait_s": sum(r.first_wait_s for r in results) / len(results),
        "mean_wait_s": sum(r.wait_s for r in results) / len(results),
        "samples": samples,
        "bytes": nbytes,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "mb_per_s": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
        "demand_samples_per_s": accelerators * workload.demand_samples_per_s,
        "epochs": samples / dataset,
    }


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def largest_passing(passes: Callable[[int], bool], max_n: int) -> int:
    """The largest n in [1, max_n] with ``passes(n)``, assuming that passing is monotone
    (0 when 1 fails): n = 1, 2, 4... (the last step clipped to max_n) until one fails, then
    bisect between the last pass and the first failure."""
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    good, n = 0, 1
    while True:
        if not passes(n):
            bad = n
            break
        good = n
        if n >= max_n:
            return good
        n = min(2 * n, max_n)
    while bad - good > 1:
        middle = (good + bad) // 2
        if passes(middle):
            good = middle
        else:
            bad = middle
    return good


# --- the benchmark ---------------------------------------------------------------------------


def make_workload(args: argparse.Namespace) -> Workload:
    return Workload.scaled(
        args.batch,
        args.compute,
        args.scale,
        batches=args.batches,
        readers=args.readers,
        prefetch=args.prefetch,
    )


def check_present(data_path: DataPath, samples: Samples) -> None:
    """The first and last sample are there with their size, or a BenchmarkFailure saying how
    to generate them."""
    for index in {0, len(samples.keys) - 1}:
        key = samples.keys[index]
        try:
            if data_path.kind == "dir":
                size = os.stat(os.path.join(data_path.location, key)).st_size
            else:
                client = s3_client(data_path.location)
                head = client.head_object(Bucket=data_path.bucket, Key=data_path.prefix + key)
                size = head["ContentLength"]
        except Exception as exc:
            raise BenchmarkFailure(
                f"{data_path}: sample {key} is missing ({type(exc).__name__}: {exc}); make the "
                "samples with `python -m bench.emulator generate` (same --samples, "
                "--sample-size, --classes, --seed) or pass --generate"
            ) from None
        if size != samples.sizes[index]:
            raise BenchmarkFailure(
                f"{data_path}: {key} has {size} bytes, expected {samples.sizes[index]}: other "
                "samples (another --sample-size or --seed?)"
            )


def warm_up(data_path: DataPath, samples: Samples, threads: int = 8) -> None:
    """Read (and check) every sample once, untimed: the data path caches what it caches, as
    after an epoch of training. Done right before a trial, after the quiet-CPU wait: this
    machine's DAMON reclaim pages out page cache that sits unused for about a minute
    (bench/README.md), so a warm-up done once before a search of many trials would be gone
    by its later trials."""
    read = data_path.opener(threads)

    def read_one(index: int) -> None:
        samples.check(index, read(samples.keys[index]))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_one, range(len(samples.keys))))


def drop_pages_after_listing(data_path: DataPath) -> None:
    """List the samples' directory (as a training job lists its dataset before it reads:
    dentries and attributes cached), then drop the page cache only (``echo 1``): every sample's
    bytes must come from the data path again, its names need no lookup."""
    if data_path.kind == "dir":
        for directory, _dirs, files in os.walk(data_path.location):
            for name in files:
                os.stat(os.path.join(directory, name))
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("1\n")


def exact_command(argv: Sequence[str]) -> str:
    """How this run was started (the interpreter relative to the working directory when
    inside it, as in the other benchmarks' reports)."""
    inside = sys.executable.startswith(os.getcwd() + os.sep)
    interpreter = os.path.relpath(sys.executable) if inside else sys.executable
    return shlex.join([interpreter, "-m", "bench.emulator", *argv])


def run_benchmark(args: argparse.Namespace) -> dict:
    data_path = parse_data_path(args.data)
    workload = make_workload(args)
    plan = plan_samples(
        args.samples, sample_size=args.sample_size, classes=args.classes, seed=args.seed
    )
    if args.generate:
        print(generate(data_path, plan), file=sys.stderr)
    samples = Samples.of(plan)
    check_present(data_path, samples)
    load_before = list(os.getloadavg())
    trials: dict[int, dict] = {}

    def measure(n: int) -> dict:
        if n not in trials:
            busy_before = wait_for_quiet_cpu(args.quiet_cpu, args.quiet_wait)
            if args.drop_caches:
                drop_page_cache()
            if args.drop_pages:
                drop_pages_after_listing(data_path)
            if args.warm_up:
                warm_up(data_path, samples)
            ticks = cpu_ticks()
            results = run_trial(
                data_path,
                samples,
                n,
                workload,
                order_seed=args.order_seed,
                mode=args.mode,
                timeout=args.trial_timeout,
            )
            trial = summarise_trial(n, results, workload, len(samples.keys))
            trial["run"] = len(trials) + 1
            trial["cpu_busy_before"] = round(busy_before, 3)
            trial["cpu_busy_during"] = round(busy_between(ticks, cpu_ticks()), 3)
            trials[n] = trial
            print(
                f"  N={n:<4} mean utilisation {trial['mean_utilisation']:6.1%} (min "
                f"{trial['min_utilisation']:.1%})  {trial['samples_per_s']:>9,.0f} samples/s "
                f"{trial['mb_per_s']:>8,.1f} MB/s  (CPU busy {trial['cpu_busy_during']:.0%})",
                file=sys.stderr,
            )
        return trials[n]

    def passes(n: int) -> bool:
        return measure(n)["mean_utilisation"] >= args.target

    if args.accelerators:
        for n in args.accelerators:
            measure(n)
        largest = max((n for n in trials if passes(n)), default=0)
        method = "the listed N only (--accelerators)"
        bound = max(args.accelerators)
    else:
        largest = largest_passing(passes, args.max_accelerators)
        method = "N doubled from 1 until a trial fell short, then bisected"
        bound = args.max_accelerators
    return {
        "benchmark": "training-input emulator",
        "date": datetime.date.today().isoformat(),
        "command": exact_command(args.argv),
        "git": git_head(),
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "data_path": str(data_path),
        "filesystem": filesystem_of(data_path.location) if data_path.kind == "dir" else "s3",
        "dataset": {
            "samples": len(samples.keys),
            "sample_size": args.sample_size,
            "classes": args.classes,
            "bytes": plan.total_bytes,
            "seed": args.seed,
        },
        "workload": {
            **asdict(workload),
            "scale": args.scale,
            "unscaled_batch": args.batch,
            "unscaled_compute_s": args.compute,
            "demand_samples_per_s_per_accelerator": workload.demand_samples_per_s,
            "order_seed": args.order_seed,
            "mode": args.mode,
            "drop_caches": args.drop_caches,
            "drop_pages": args.drop_pages,
            "warm_up": args.warm_up,
        },
        "verification": "every sample's length and xxh3_64 checked against the generator's bytes",
        "trials": sorted(trials.values(), key=lambda t: t["accelerators"]),
        "search": {
            "target_utilisation": args.target,
            "method": method,
            "max_accelerators": bound,
            "largest_accelerators": largest,
            "bound_reached": largest == bound,
        },
        "notes": list(args.note or []),
    }


# --- report ----------------------------------------------------------------------------------


def render_markdown(results: dict) -> str:
    m, d, w, s = results["machine"], results["dataset"], results["workload"], results["search"]
    demand = w["demand_samples_per_s_per_accelerator"]
    lines = [
        f"## Training-input emulator — {results['date']}",
        "",
        f"- machine: {m['nproc']} cores ({m['cpu']}), {m['memory_bytes'] / 2**30:.1f} GiB, "
        f"kernel {m['kernel']}, Python {m['python']}; load average before "
        f"{' / '.join(f'{x:.2f}' for x in results['load_before'])}",
        f"- data path: `{results['data_path']}` ({results['filesystem']})",
        f"- samples: {d['samples']:,} x {d['sample_size']:,} B ({d['bytes'] / 1e9:.2f} GB) in "
        f"{d['classes']} class directories, seed {d['seed']}; {results['verification']}",
        f"- per accelerator: batch {w['batch']}, compute {1000 * w['compute_s']:.1f} ms per "
        f"batch (scale {w['scale']:g} of {w['unscaled_batch']} / "
        f"{1000 * w['unscaled_compute_s']:.4g} ms), so it consumes {demand:,.0f} samples/s "
        f"({demand * d['sample_size'] / 1e6:,.0f} MB/s) when it never waits; {w['batches']} "
        f"batches per trial; {w['readers']} reader threads; readers up to {w['prefetch']} "
        f"batch(es) ahead; accelerators run as {w['mode']}es"
        + ("; page cache dropped before each trial" if w["drop_caches"] else "")
        + (
            "; samples listed, then page cache dropped (dentries kept) before each trial"
            if w.get("drop_pages")
            else ""
        )
        + ("; every sample read once right before each trial" if w.get("warm_up") else ""),
        f"- command: `{results['command']}`",
        "",
        "| accelerators | mean utilisation | min | after 1st batch | samples/s | MB/s "
        "| wanted samples/s | s | epochs read | CPU busy | run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in results["trials"]:
        steady = t["mean_steady_utilisation"]
        lines.append(
            f"| {t['accelerators']} | {t['mean_utilisation']:.1%} | {t['min_utilisation']:.1%} "
            f"| {'—' if steady is None else f'{steady:.1%}'} | {t['samples_per_s']:,.0f} "
            f"| {t['mb_per_s']:,.1f} | {t['demand_samples_per_s']:,.0f} | {t['seconds']:.2f} "
            f"| {t['epochs']:.2f} | {t['cpu_busy_during']:.0%} | {t['run']} |"
        )
    bound = " (the bound was reached: more may fit)" if s["bound_reached"] else ""
    lines += [
        "",
        f"**Largest N with mean utilisation >= {s['target_utilisation']:.0%}: "
        f"{s['largest_accelerators']}** ({s['method']}; at most {s['max_accelerators']}){bound}.",
        "",
        "Utilisation per accelerator:",
        "",
    ]
    for t in results["trials"]:
        lines.append(f"- N={t['accelerators']}: " + ", ".join(f"{u:.3f}" for u in t["utilisation"]))
    if results.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


# --- command line ----------------------------------------------------------------------------


def _accelerator_list(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"accelerator counts must be >= 1: {text!r}")
    return values


def _data_path_arg(text: str) -> str:
    try:
        parse_data_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_sample_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=10_000, help="files in the dataset")
    parser.add_argument("--sample-size", type=int, default=SAMPLE_SIZE, help="bytes per sample")
    parser.add_argument("--classes", type=int, default=100, help="class directories")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (names and bytes)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.emulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data", required=True, type=_data_path_arg, help="dir:PATH or s3:ENDPOINT/BUCKET/PREFIX"
    )
    _add_sample_options(parser)
    parser.add_argument("--generate", action="store_true", help="write the samples there first")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per batch")
    parser.add_argument(
        "--compute", type=parse_duration, default=COMPUTE_S, help="compute per batch: 0.224, 224ms"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply batch and compute by this (quick runs)"
    )
    parser.add_argument("--batches", type=int, default=50, help="batches per accelerator per trial")
    parser.add_argument("--readers", type=int, default=4, help="reader threads per accelerator")
    parser.add_argument("--prefetch", type=int, default=1, help="batches read ahead of compute")
    parser.add_argument(
        "--accelerators", type=_accelerator_list, help="measure these N (e.g. 1,2,4), no search"
    )
    parser.add_argument("--max-accelerators", type=int, default=64, help="the search's bound")
    parser.add_argument(
        "--target", type=float, default=TARGET_UTILISATION, help="mean utilisation to keep"
    )
    parser.add_argument(
        "--mode",
        choices=["process", "thread"],
        default="process",
        help="one process per accelerator (default), or all in threads of one process",
    )
    parser.add_argument("--order-seed", type=int, default=1, help="shuffled order seed")
    before_trial = parser.add_mutually_exclusive_group()
    before_trial.add_argument(
        "--drop-caches", action="store_true", help="drop the page cache before each trial (root)"
    )
    before_trial.add_argument(
        "--drop-pages",
        action="store_true",
        help="list the samples, then drop the page cache only, keeping dentries (echo 1; root)",
    )
    before_trial.add_argument(
        "--warm-up",
        action="store_true",
        help="read every sample once right before each trial (a later epoch: what the data "
        "path caches is warm, even where idle page cache is reclaimed)",
    )
    parser.add_argument(
        "--quiet-cpu", type=float, default=0.3, help="start a trial once at most this much CPU..."
    )
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="...or after this many s")
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial")
    parser.add_argument("--json", help="write the JSON results here (default: stdout)")
    parser.add_argument("--save-dir", help="also write <dir>/<YYYY-MM-DD>.json and .md")
    parser.add_argument("--note", action="append", help="a note to store with the results")
    return parser


def generate_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.emulator generate",
        description="Write (dir:) or upload (s3:) the emulator's samples.",
    )
    parser.add_argument("data", type=_data_path_arg, help="dir:PATH or s3:ENDPOINT/BUCKET/PREFIX")
    _add_sample_options(parser)
    parser.add_argument("--threads", type=int, default=8, help="concurrent writes or PUTs")
    args = parser.parse_args(argv)
    plan = plan_samples(
        args.samples, sample_size=args.sample_size, classes=args.classes, seed=args.seed
    )
    print(generate(parse_data_path(args.data), plan, threads=args.threads))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run_and_report("emulator", args, run_benchmark, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
