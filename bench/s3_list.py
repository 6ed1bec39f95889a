"""Benchmark: listing a bucket through cachefs's S3 store, per timestamp parser.

    python -m bench.s3_list [--objects 20000] [--repeats 3] [--json FILE] [--save-dir DIR]

A dataset add or refresh lists the whole bucket (``S3Store.list``: ListObjectsV2 pages of
1,000 keys through botocore). Every object of a page carries a LastModified timestamp, and
botocore parses each with dateutil unless told otherwise; cachefs gives its sessions
``cachefs.store.s3.parse_timestamp`` instead. This lists ``--objects`` empty objects served by
``bench/lean_s3.py`` (keep-alive, tens of µs per request: the client is what is measured) with
both parsers, alternated ``--repeats`` times in one run, and reports objects/s and the CPU time
of this process per 1,000 objects (best of the repeats). It checks that both listings give the
same keys, sizes, ETags and mtimes. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

import botocore.utils

from bench.lean_s3 import LeanS3Process
from cachefs.store import s3
from cachefs.store.base import StoreConfig

BUCKET = "bench-list"


def make_tree(root: str, objects: int) -> None:
    """``objects`` empty files, 1,000 per directory (like the classes of an image dataset)."""
    for i in range(objects):
        directory = os.path.join(root, f"class{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(directory, exist_ok=True)
        open(os.path.join(directory, f"img{i:08d}.jpg"), "wb").close()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def list_once(endpoint: str, parser_name: str) -> tuple[float, float, list]:
    """Wall and CPU seconds of one full listing with a new store whose sessions use the
    parser named, and what it listed."""
    original = s3.parse_timestamp
    if parser_name == "botocore (dateutil)":
        s3.parse_timestamp = botocore.utils.parse_timestamp  # what make_session installs
    try:
        store = s3.S3Store(StoreConfig(uri=f"s3://{BUCKET}", endpoint=endpoint))
    finally:
        s3.parse_timestamp = original
    try:
        cpu, wall = cpu_seconds(), time.perf_counter()
        listed = list(store.list())
        return time.perf_counter() - wall, cpu_seconds() - cpu, listed
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    parser.add_argument("--save-dir", help="write <dir>/<date>.json and .md")
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")  # lean_s3 checks no signature
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    parsers = ["botocore (dateutil)", "cachefs (fromisoformat)"]
    root = tempfile.mkdtemp(prefix="s3-list-bench-")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in parsers}
    try:
        make_tree(root, args.objects)
        with LeanS3Process(root, BUCKET) as server:
            listings = {}
            for _ in range(args.repeats):
                for name in parsers:
                    wall, cpu, listed = list_once(server.url, name)
                    runs[name].append((wall, cpu))
                    listings[name] = listed
            if listings[parsers[0]] != listings[parsers[1]]:
                raise SystemExit("s3_list: the two parsers listed different objects")
            if len(listings[parsers[0]]) != args.objects:
                raise SystemExit(f"s3_list: listed {len(listings[parsers[0]])} objects")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, kernel {platform.release()}, "
        f"Python {platform.python_version()}",
        "command": " ".join(["python", "-m", "bench.s3_list", *sys.argv[1:]]),
        "objects": args.objects,
        "parsers": {
            name: {
                "objects_per_s": round(args.objects / min(w for w, _ in times)),
                "cpu_ms_per_1000": round(1000 * min(c for _, c in times) / args.objects * 1000, 1),
                "runs": [{"wall_s": round(w, 3), "cpu_s": round(c, 3)} for w, c in times],
            }
            for name, times in runs.items()
        },
    }
    text = json.dumps(results, indent=2)
    table = render(results)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    print(table)
    if args.save_dir:
        os.makedirs(args.save_dir, exist_ok=True)
        for suffix, body in (("json", text), ("md", table)):
            with open(os.path.join(args.save_dir, f"{results['date']}.{suffix}"), "w") as f:
                f.write(body + "\n")
    return 0


def render(results: dict) -> str:
    lines = [
        f"# Listing a bucket through S3Store, per timestamp parser — {results['date']}",
        "",
        f"Machine: {results['machine']}. Command: `{results['command']}`. "
        f"{results['objects']:,} objects from bench/lean_s3.py; best of the alternated runs.",
        "",
        "| timestamp parser | objects/s | client CPU ms per 1,000 objects |",
        "|---|---:|---:|",
    ]
    for name, row in results["parsers"].items():
        lines.append(f"| {name} | {row['objects_per_s']:,} | {row['cpu_ms_per_1000']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
