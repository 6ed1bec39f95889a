"""How many GETs/s the benchmarks' fake object stores can serve, and the delay proxy in front.

    .venv/bin/python -m bench.store_ceiling                          # moto and lean_s3, ~3 min
    .venv/bin/python -m bench.store_ceiling --stores lean --seconds 3 \
        --save bench/results/store_ceiling/DATE.md

Every benchmark whose numbers come from the store (first reads, preload, raw boto3 GETs) is
bounded by what the store itself can serve on the same machine: this measures that bound, so
those numbers can be read as a ratio to it. For each endpoint — moto_server (in memory) and
``bench/lean_s3.py`` (a directory served by asyncio processes), each directly and behind
``bench/delay_proxy.py`` with 0 ms and 20 ms first-byte delay — it measures:

* **small GETs**: whole-object GETs of ``--objects`` objects of ``--object-size`` (110 KB, the
  ImageNet-like mean) at each ``--concurrency`` (1, 16, 64, 256 requests in flight), with two
  clients: ``boto3`` (``get_object`` from that many threads of one process, as the benchmarks'
  raw-GET rows do: it measures boto3 as much as the store) and ``raw`` (the cheapest client
  that can be written in Python: ``--client-processes`` processes, each driving its share of
  keep-alive connections from one ``selectors`` loop, unsigned requests built once, only the
  status line and Content-Length parsed; lean_s3 and moto check no signature);
* **large ranged GETs**: ``--large-size`` (64 MiB) object read as parallel ranged GETs of
  ``--range-size`` (8 MiB), as many in flight as the object has ranges, with both clients.

Each pass runs ``--seconds`` after every connection is open and counts the answers that
completed (every body's length is checked; a wrong status or length counts as an error). The
columns: requests/s, MB/s, errors, **reconnects** (connections the server closed under the raw
client: moto closes after every answer), **TIME-WAIT** (sockets in TIME-WAIT on the pass's
ports, from /proc/net/tcp, after the pass, and how many more than before it), **vs store**: the
rate over the store's own ceiling (its best ``raw`` small-GET rate, direct, same run), and for
the delayed endpoints **vs c/delay**: the rate over the latency bound (concurrency / delay);
**store CPU** and **proxy CPU**: CPU seconds their processes used per second of the pass (1.00
is one core busy; the machine's cores are shared with the client).

Prints the results as JSON on stdout and a markdown report on stderr; ``--save PATH.md`` also
writes the report there and the JSON next to it. Nothing here is imported by cachefs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import selectors
import shlex
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

from bench.lean_s3 import LeanS3Process
from bench.read_bench import MOTO_ENV, MotoProcess
from bench.suite.backend import ProxyProcess
from cachefs.units import format_size, parse_size
from harness.processes import cpu_seconds

BUCKET = "store-ceiling"
STORES = ("moto", "lean")
DEFAULT_CONCURRENCY = (1, 16, 64, 256)
DEFAULT_DELAYS_MS = (0.0, 20.0)
#: The raw client's receive buffer: large enough that a 110 KB body takes a few recv calls.
RECV_CHUNK = 1024 * 1024
#: TCP state 06 in /proc/net/tcp is TIME_WAIT.
TIME_WAIT_STATE = "06"


@dataclass
class Endpoint:
    name: str  # "lean", "moto+proxy20ms", ...
    store: str  # "lean" or "moto"
    url: str
    delay_ms: float | None  # None: the store directly
    ports: tuple[int, ...]  # the endpoint's port and its upstream's (for TIME-WAIT counting)
    store_pid: int
    proxy_pid: int | None = None


@dataclass
class PassResult:
    endpoint: str
    store: str
    delay_ms: float | None
    workload: str  # "small" or "large"
    client: str  # "raw" or "boto3"
    concurrency: int
    requests: int
    seconds: float
    bytes: int
    errors: int
    reconnects: int
    time_wait_after: int
    time_wait_new: int
    store_cores: float  # CPU seconds of the store's processes per second of the pass
    proxy_cores: float | None
    requests_per_s: float = 0.0
    mb_per_s: float = 0.0
    vs_store: float | None = None
    vs_latency_bound: float | None = None
    error_samples: list[str] = field(default_factory=list)


# --- sockets in TIME-WAIT ----------------------------------------------------------------------


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (lean_s3's server processes)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            total += cpu_seconds(current)
            with open(f"/proc/{current}/task/{current}/children") as children:
                pending += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def time_wait_count(ports: tuple[int, ...]) -> int:
    """Sockets in TIME-WAIT whose local or remote port is one of ``ports`` (IPv4 and IPv6)."""
    wanted = set(ports)
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] != TIME_WAIT_STATE:
                        continue
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    remote = int(fields[2].rsplit(":", 1)[1], 16)
                    count += local in wanted or remote in wanted
        except FileNotFoundError:
            continue
    return count


# --- the raw client ------------------------------------------------------------------------------


class RawConnection:
    """One keep-alive HTTP/1.1 connection driven by a selector loop: sends a request, reads
    the status line, the Content-Length and the body, then sends the next."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self.sock: socket.socket | None = None
        self.buffer = bytearray()
        self.expected = 0  # the body length this request must answer with
        self.body_left = -1  # -1: still reading the head
        self.close_after = False
        self.failure: str | None = None  # what was wrong with the answer being read
        self.request = b""

    def connect(self) -> None:
        sock = socket.create_connection(self.address, timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock

    def send(self, request: bytes, expected: int) -> None:
        self.request, self.expected = request, expected
        self.buffer.clear()
        self.body_left = -1
        self.close_after = False
        self.failure = None
        self.sock.setblocking(True)  # requests are small: one blocking send
        self.sock.sendall(request)
        self.sock.setblocking(False)

    def receive(self) -> tuple[str, int] | None:
        """Read what arrived; ``("ok" | error text, body bytes)`` once the answer is complete,
        ``("closed", 0)`` when the server hung up first, None while incomplete."""
        try:
            data = self.sock.recv(RECV_CHUNK)
        except BlockingIOError:
            return None
        except ConnectionError:
            return "closed", 0
        if not data:
            return "closed", 0
        if self.body_left >= 0:
            self.body_left -= len(data)
        else:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return None
            head = self.buffer[:end].decode("latin-1").lower()
            status = head[9:12]
            length = -1
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and "close" in value:
                    self.close_after = True
            if length < 0:
                return "no Content-Length", 0
            self.body_left = length - (len(self.buffer) - end - 4)
            self.buffer.clear()
            if status not in ("200", "206") or length != self.expected:
                self.failure = f"HTTP {status}, {length} bytes"  # reported once it is read
        if self.body_left > 0:
            return None
        if self.failure is not None:
            return self.failure, 0
        return "ok", self.expected

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def raw_client_process(address, requests, connections, seconds, ready, start, results):
    """One client process: ``connections`` keep-alive connections, each sending the next of
    ``requests`` (``(request bytes, expected body length)``, cycled) as soon as its previous
    answer is complete, for ``seconds`` after ``start`` is set."""
    try:
        conns = [RawConnection(address) for _ in range(connections)]
        for conn in conns:
            conn.connect()
    except OSError as exc:
        ready.put(f"connect failed: {exc}")
        return
    ready.put(None)
    start.wait()
    selector = selectors.DefaultSelector()
    next_request = 0
    done = body_bytes = errors = reconnects = 0
    error_samples: list[str] = []

    def send(conn: RawConnection, request: bytes, expected: int) -> None:
        nonlocal reconnects
        try:
            conn.send(request, expected)
        except ConnectionError:  # closed by the server since its last answer
            selector.unregister(conn.sock)
            conn.close()
            reconnects += 1
            conn.connect()
            selector.register(conn.sock, selectors.EVENT_READ, conn)
            conn.send(request, expected)

    def send_next(conn: RawConnection) -> None:
        nonlocal next_request
        request, expected = requests[next_request % len(requests)]
        next_request += 1
        send(conn, request, expected)

    began = time.monotonic()
    deadline = began + seconds
    for conn in conns:
        selector.register(conn.sock, selectors.EVENT_READ, conn)
        send_next(conn)
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        for key, _ in selector.select(timeout=deadline - now):
            conn = key.data
            outcome = conn.receive()
            if outcome is None:
                continue
            status, nbytes = outcome
            if status == "ok":
                done += 1
                body_bytes += nbytes
            elif status != "closed":
                errors += 1
                if len(error_samples) < 3:
                    error_samples.append(status)
            if status == "closed" or conn.close_after:
                selector.unregister(conn.sock)
                conn.close()
                reconnects += 1
                conn.connect()
                selector.register(conn.sock, selectors.EVENT_READ, conn)
                if status == "closed":  # the request was lost with the connection: resend
                    send(conn, conn.request, conn.expected)
                    continue
            send_next(conn)
    elapsed = time.monotonic() - began
    for conn in conns:
        conn.close()
    results.put((done, body_bytes, errors, reconnects, elapsed, error_samples))


def run_raw(
    endpoint: Endpoint, requests, concurrency: int, processes: int, seconds: float
) -> tuple[int, int, int, int, float, list[str]]:
    """The raw client with ``concurrency`` connections over ``processes`` processes."""
    split = urllib.parse.urlsplit(endpoint.url)
    address = (split.hostname, split.port)
    context = multiprocessing.get_context("fork")
    ready, results, start = context.Queue(), context.Queue(), context.Event()
    processes = min(processes, concurrency)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    children = []
    for number, share in enumerate(shares):
        rotated = requests[number * len(requests) // processes :] + requests
        child = context.Process(
            target=raw_client_process,
            args=(address, rotated, share, seconds, ready, start, results),
            daemon=True,
        )
        child.start()
        children.append(child)
    try:
        failures = [message for message in (ready.get(timeout=120) for _ in children) if message]
        if failures:
            raise RuntimeError(f"raw client against {endpoint.name}: {failures[0]}")
        start.set()
        outcomes = [results.get(timeout=seconds + 120) for _ in children]
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    samples = [sample for outcome in outcomes for sample in outcome[5]][:3]
    return (
        sum(o[0] for o in outcomes),
        sum(o[1] for o in outcomes),
        sum(o[2] for o in outcomes),
        sum(o[3] for o in outcomes),
        max(o[4] for o in outcomes),
        samples,
    )


def raw_requests(url: str, keys: list[str], sizes: dict[str, int], span: int | None = None):
    """``(request bytes, expected body length)`` for each key (whole objects), or for each
    ``span``-byte range of the one key (``span`` set)."""
    host = urllib.parse.urlsplit(url).netloc
    requests = []
    if span is None:
        for key in keys:
            target = f"/{BUCKET}/{urllib.parse.quote(key)}"
            requests.append((f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), sizes[key]))
        return requests
    (key,) = keys
    target = f"/{BUCKET}/{urllib.parse.quote(key)}"
    for first in range(0, sizes[key], span):
        last = min(first + span, sizes[key]) - 1
        head = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={first}-{last}\r\n\r\n"
        requests.append((head.encode(), last - first + 1))
    return requests


# --- the boto3 client ----------------------------------------------------------------------------


def boto3_client(url: str, pool: int):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name=MOTO_ENV["AWS_DEFAULT_REGION"],
        aws_access_key_id=MOTO_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=pool,
            retries={"total_max_attempts": 1},
        ),
    )


def run_boto3(
    endpoint: Endpoint, gets: list[tuple[str, str | None, int]], concurrency: int, seconds: float
) -> tuple[int, int, int, int, float, list[str]]:
    """``concurrency`` threads of this process, one boto3 client, each sending the next of
    ``gets`` (``(key, Range or None, expected length)``, cycled) for ``seconds``."""
    client = boto3_client(endpoint.url, concurrency)
    counts = {"done": 0, "bytes": 0, "errors": 0}
    samples: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency + 1)
    window = {"deadline": 0.0}

    def get(number: int) -> int:
        key, byte_range, _ = gets[number % len(gets)]
        extra = {"Range": byte_range} if byte_range else {}
        return len(client.get_object(Bucket=BUCKET, Key=key, **extra)["Body"].read())

    def worker(index: int) -> None:
        get(index)  # its connection open before the clock starts
        barrier.wait()
        number = index
        while time.monotonic() < window["deadline"]:
            number += concurrency
            try:
                ok = get(number) == gets[number % len(gets)][2]
                error = None if ok else "wrong length"
            except Exception as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"[:200]
            with lock:
                if ok:
                    counts["done"] += 1
                    counts["bytes"] += gets[number % len(gets)][2]
                else:
                    counts["errors"] += 1
                    if len(samples) < 3:
                        samples.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    window["deadline"] = time.monotonic() + 10**9  # set for real once everyone is connected
    barrier.wait(timeout=300)
    began = time.monotonic()
    window["deadline"] = began + seconds
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    client.close()
    return counts["done"], counts["bytes"], counts["errors"], 0, elapsed, samples


# --- the run -------------------------------------------------------------------------------------


def make_data(root: str, objects: int, object_size: int, large_size: int) -> dict[str, int]:
    """The objects as files under ``root`` (rewritten only when their size differs): key ->
    size. Bytes are random: no store or client may compress them."""
    sizes = {f"small/obj-{number:05d}": object_size for number in range(objects)}
    sizes["large/shard-0"] = large_size
    for key, size in sizes.items():
        path = os.path.join(root, key)
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(os.urandom(size))
    return sizes


def upload_to_moto(moto: MotoProcess, root: str, sizes: dict[str, int]) -> None:
    client = moto.client()
    client.create_bucket(Bucket=BUCKET)
    for key in sizes:
        with open(os.path.join(root, key), "rb") as data:
            # Readable without a signature: the raw client sends none.
            client.put_object(Bucket=BUCKET, Key=key, Body=data.read(), ACL="public-read")


def port_of(url: str) -> int:
    return urllib.parse.urlsplit(url).port


def measure_endpoint(endpoint: Endpoint, args, sizes: dict[str, int]) -> list[PassResult]:
    small_keys = sorted(key for key in sizes if key.startswith("small/"))
    large_key = "large/shard-0"
    passes = []
    for concurrency in args.concurrency:
        for client in args.clients:
            passes.append(("small", client, concurrency))
    ranges = -(-sizes[large_key] // args.range_size)
    for client in args.clients:
        passes.append(("large", client, ranges))
    results = []
    for workload, client, concurrency in passes:
        if workload == "small":
            raw = raw_requests(endpoint.url, small_keys, sizes)
            gets = [(key, None, sizes[key]) for key in small_keys]
        else:
            raw = raw_requests(endpoint.url, [large_key], sizes, span=args.range_size)
            gets = [
                (large_key, f"bytes={first}-{first + length - 1}", length)
                for first, length in (
                    (first, min(args.range_size, sizes[large_key] - first))
                    for first in range(0, sizes[large_key], args.range_size)
                )
            ]
        time_wait_before = time_wait_count(endpoint.ports)
        store_cpu_before = process_tree_cpu_s(endpoint.store_pid)
        proxy_cpu_before = process_tree_cpu_s(endpoint.proxy_pid) if endpoint.proxy_pid else 0
        if client == "raw":
            outcome = run_raw(endpoint, raw, concurrency, args.client_processes, args.seconds)
        else:
            outcome = run_boto3(endpoint, gets, concurrency, args.seconds)
        done, nbytes, errors, reconnects, elapsed, samples = outcome
        time_wait_after = time_wait_count(endpoint.ports)
        store_cpu = process_tree_cpu_s(endpoint.store_pid) - store_cpu_before
        proxy_cpu = (
            process_tree_cpu_s(endpoint.proxy_pid) - proxy_cpu_before if endpoint.proxy_pid else 0
        )
        result = PassResult(
            endpoint=endpoint.name,
            store=endpoint.store,
            delay_ms=endpoint.delay_ms,
            workload=workload,
            client=client,
            concurrency=concurrency,
            requests=done,
            seconds=round(elapsed, 3),
            bytes=nbytes,
            errors=errors,
            reconnects=reconnects,
            time_wait_after=time_wait_after,
            time_wait_new=max(0, time_wait_after - time_wait_before),
            store_cores=round(store_cpu / elapsed, 2),
            proxy_cores=round(proxy_cpu / elapsed, 2) if endpoint.proxy_pid else None,
            requests_per_s=round(done / elapsed, 1),
            mb_per_s=round(nbytes / elapsed / 1e6, 1),
            error_samples=samples,
        )
        if endpoint.delay_ms:
            bound = concurrency / (endpoint.delay_ms / 1000)
            result.vs_latency_bound = round(result.requests_per_s / bound, 3)
        print(
            f"  {endpoint.name:>16} {workload:5} {client:5} c={concurrency:<3} "
            f"{result.requests_per_s:9.1f} req/s {result.mb_per_s:8.1f} MB/s "
            f"errors {errors} reconnects {reconnects} TIME-WAIT {time_wait_after} "
            f"store {result.store_cores} cores proxy {result.proxy_cores} cores",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    return results


def add_ratios(results: list[PassResult]) -> dict[str, float]:
    """Each row's rate over its store's ceiling (best raw small-GET rate, direct; large rows:
    best raw large-GET MB/s, direct); returns the ceilings."""
    ceilings: dict[str, float] = {}
    for row in results:
        if row.delay_ms is None and row.client == "raw":
            value = row.requests_per_s if row.workload == "small" else row.mb_per_s
            name = f"{row.store}:{row.workload}"
            ceilings[name] = max(ceilings.get(name, 0.0), value)
    for row in results:
        ceiling = ceilings.get(f"{row.store}:{row.workload}")
        value = row.requests_per_s if row.workload == "small" else row.mb_per_s
        if ceiling:
            row.vs_store = round(value / ceiling, 3)
    return ceilings


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as info:
        mem_kib = int(next(line for line in info if line.startswith("MemTotal")).split()[1])
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def render_markdown(report: dict) -> str:
    config = report["config"]
    lines = [
        f"# Store ceiling, {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"{report['machine']['memory_gib']} GiB, kernel {report['machine']['kernel']}, "
        f"Python {report['machine']['python']}.",
        "",
        f"{config['objects']} small objects of {format_size(config['object_size'])}; one "
        f"{format_size(config['large_size'])} object read as ranged GETs of "
        f"{format_size(config['range_size'])}; {config['seconds']} s per pass; raw client in "
        f"{config['client_processes']} processes; lean_s3 with {config['lean_processes']} "
        "process(es).",
        "",
        "Store ceilings (best raw-client rate, store direct): "
        + ", ".join(f"{name} {value:,.0f}" for name, value in report["ceilings"].items())
        + " (small: requests/s, large: MB/s).",
        "",
    ]
    for workload, title in (("small", "Small GETs"), ("large", "Large object, ranged GETs")):
        lines += [
            f"## {title}",
            "",
            "| endpoint | client | in flight | req/s | MB/s | vs store | vs c/delay | errors "
            "| reconnects | TIME-WAIT after (new) | store CPU | proxy CPU |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in report["results"]:
            if row["workload"] != workload:
                continue
            vs_store = f"{row['vs_store']:.2f}" if row["vs_store"] is not None else ""
            vs_bound = (
                f"{row['vs_latency_bound']:.2f}" if row["vs_latency_bound"] is not None else ""
            )
            proxy_cores = f"{row['proxy_cores']:.2f}" if row["proxy_cores"] is not None else ""
            lines.append(
                f"| {row['endpoint']} | {row['client']} | {row['concurrency']} "
                f"| {row['requests_per_s']:,.1f} | {row['mb_per_s']:,.1f} | {vs_store} "
                f"| {vs_bound} | {row['errors']} | {row['reconnects']} "
                f"| {row['time_wait_after']:,} ({row['time_wait_new']:,}) "
                f"| {row['store_cores']:.2f} | {proxy_cores} |"
            )
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    def number_list(kind):
        return lambda text: tuple(kind(part) for part in text.split(",") if part)

    parser = argparse.ArgumentParser(
        prog="python -m bench.store_ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stores", type=lambda t: tuple(t.split(",")), default=STORES)
    parser.add_argument(
        "--delays",
        type=number_list(float),
        default=DEFAULT_DELAYS_MS,
        help="proxy delays in ms to measure behind (default 0,20; '' for none)",
    )
    parser.add_argument("--concurrency", type=number_list(int), default=DEFAULT_CONCURRENCY)
    parser.add_argument("--clients", type=lambda t: tuple(t.split(",")), default=("raw", "boto3"))
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--object-size", type=parse_size, default=110_000)
    parser.add_argument("--large-size", type=parse_size, default=64 * 2**20)
    parser.add_argument("--range-size", type=parse_size, default=8 * 2**20)
    parser.add_argument("--seconds", type=float, default=2.0, help="per pass (default 2)")
    parser.add_argument("--client-processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--lean-processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", default="/tmp/cachefs-store-ceiling")
    parser.add_argument("--save", help="write the report to this .md (and the JSON next to it)")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.stores) - set(STORES) or set(args.clients) - {"raw", "boto3"}
    if unknown:
        raise SystemExit(f"store_ceiling: unknown store or client {sorted(unknown)}")
    root = os.path.join(args.workdir, "root")
    sizes = make_data(root, args.objects, args.object_size, args.large_size)
    results: list[PassResult] = []
    for store in args.stores:
        children: list = []
        try:
            if store == "moto":
                moto = MotoProcess(os.path.join(args.workdir, "moto.log"))
                children.append(moto)
                upload_to_moto(moto, root, sizes)
                store_url = moto.endpoint
            else:
                lean = LeanS3Process(
                    root,
                    BUCKET,
                    processes=args.lean_processes,
                    log_path=os.path.join(args.workdir, "lean_s3.log"),
                )
                children.append(lean)
                store_url = lean.url
            store_pid = children[0].pid if store == "lean" else children[0]._process.pid
            endpoints = [Endpoint(store, store, store_url, None, (port_of(store_url),), store_pid)]
            for delay in args.delays:
                log = os.path.join(args.workdir, f"proxy-{store}-{delay:g}.log")
                proxy = ProxyProcess(store_url, delay, log)
                children.append(proxy)
                endpoints.append(
                    Endpoint(
                        f"{store}+proxy{delay:g}ms",
                        store,
                        proxy.url,
                        delay,
                        (port_of(proxy.url), port_of(store_url)),
                        store_pid,
                        proxy.pid,
                    )
                )
            for endpoint in endpoints:
                results += measure_endpoint(endpoint, args, sizes)
        finally:
            for child in reversed(children):
                child.stop()
    ceilings = add_ratios(results)
    report = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(
            [os.path.relpath(sys.executable), "-m", "bench.store_ceiling",
             *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": machine(),
        "config": {
            "objects": args.objects,
            "object_size": args.object_size,
            "large_size": args.large_size,
            "range_size": args.range_size,
            "seconds": args.seconds,
            "client_processes": args.client_processes,
            "lean_processes": args.lean_processes,
        },
        "ceilings": ceilings,
        "results": [asdict(row) for row in results],
    }  # fmt: skip
    markdown = render_markdown(report)
    print(json.dumps(report, indent=1))
    print(markdown, file=sys.stderr)
    if args.save:
        with open(args.save, "w") as out:
            out.write(markdown)
        with open(os.path.splitext(args.save)[0] + ".json", "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
