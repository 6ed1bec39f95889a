"""What running every store read as hedged tries costs the client: CPU per GET of
``S3Store.get_range`` (each try on a pool thread, its outcome handed back to the caller) against
the very same botocore call made inline, on the store's own client: in the calling thread
(``inline``: a preload fetcher process calls the store so), and handed to another thread and
back (``inline_thread``: the worker's read path calls the store through ``trio.to_thread``, so
the old store's cost there included one such hop). The pool's threads allocate bodies from their
own malloc arenas, which glibc trims more eagerly than the main one: for large bodies part of
the difference is page faults (try ``MALLOC_ARENA_MAX=1``).

    .venv/bin/python -m bench.store_hedging                    # prints JSON, then a table
    .venv/bin/python -m bench.store_hedging --sizes 4KiB,4MiB --gets 2000

The server is a minimal ranged-GET HTTP server in a child process on 127.0.0.1 (moto spends
milliseconds of its own per GET, which would drown the difference), answering every key with
the same bytes. CPU is this process's (``time.process_time``: the pool's threads included),
the median of ``--repeats`` runs, each of ``--gets`` sequential GETs of one size. No stall is
injected: this is the price of the machinery when the store is healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cachefs.store.base import StoreConfig
from cachefs.store.s3 import S3Store
from cachefs.units import format_size, parse_size
from tests.fakes.moto import free_port

SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    BODY = bytes(range(256)) * (int(sys.argv[2]) // 256 + 1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1  # headers and body in one write: no Nagle/delayed-ACK stalls
        disable_nagle_algorithm = True

        def do_GET(self):
            first, last = self.headers["Range"].split("=")[1].split("-")
            body = BODY[int(first) : int(last) + 1]
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", '"bench"')
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def cpu_per_get(get: Callable[[], bytes], size: int, gets: int) -> float:
    start = time.process_time()
    for _ in range(gets):
        if len(get()) != size:
            raise AssertionError("short read")
    return (time.process_time() - start) / gets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4KiB,256KiB,4MiB", help="GET sizes, comma-separated")
    parser.add_argument("--gets", type=int, default=1000, help="GETs per run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(max(sizes))])
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    # lean_gets=False: the hedged reads then make the very same botocore call as the inline
    # variants (the lean client, S3Store's default for ranged GETs, is measured by
    # bench/store_fetch_rate.py).
    store = S3Store(
        StoreConfig("s3://bench/data", endpoint=f"http://127.0.0.1:{port}"), lean_gets=False
    )
    hop = ThreadPoolExecutor(1)
    results = []
    try:
        for _ in range(600):  # the server is up once it answers (bounded: a minute)
            try:
                store._client.get_object(Bucket="bench", Key="data/k", Range="bytes=0-0")
                break
            except Exception:
                time.sleep(0.1)
        for size in sizes:
            request = {"Bucket": "bench", "Key": "data/k", "Range": f"bytes=0-{size - 1}"}

            def inline(request=request) -> bytes:
                body = store._client.get_object(**request)["Body"]
                try:
                    return body.read()
                finally:
                    body.close()

            def inline_thread(inline=inline) -> bytes:
                return hop.submit(inline).result()

            def hedged(size=size) -> bytes:
                return store.get_range("k", 0, size, etag="bench")

            variants = {"inline": inline, "inline_thread": inline_thread, "hedged": hedged}
            runs: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):  # interleaved, so that load changes hit all alike
                for name, get in variants.items():
                    runs[name].append(cpu_per_get(get, size, args.gets))
            median_us = {name: statistics.median(r) * 1e6 for name, r in runs.items()}
            results.append(
                {
                    "size": size,
                    **{f"{name}_cpu_us_per_get": round(us, 1) for name, us in median_us.items()},
                    "overhead_us_per_get": round(median_us["hedged"] - median_us["inline"], 1),
                    "overhead_fraction": round(median_us["hedged"] / median_us["inline"] - 1, 3),
                    "runs_us": {k: [round(v * 1e6, 1) for v in r] for k, r in runs.items()},
                }
            )
    finally:
        hop.shutdown()
        store.close()
        server.kill()
        server.wait()
    report = {
        "benchmark": "store_hedging",
        "gets_per_run": args.gets,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    print(json.dumps(report, indent=2))
    print(
        "\n| size | µs CPU/GET: inline | inline, another thread | hedged | hedged − inline |"
        "\n|---:|---:|---:|---:|---:|",
        file=sys.stderr,
    )
    for row in results:
        print(
            f"| {format_size(row['size'])} | {row['inline_cpu_us_per_get']:.0f} "
            f"| {row['inline_thread_cpu_us_per_get']:.0f} | {row['hedged_cpu_us_per_get']:.0f} "
            f"| {row['overhead_us_per_get']:+.0f} µs ({row['overhead_fraction']:+.1%}) |",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
