"""An ImageNet-like dataset generator for benchmarks: class directories of JPEG-sized files.

    python -m bench.datagen /tmp/imagenet-like --files 10000
    python -m bench.datagen s3://bench-data/imagenet --endpoint http://127.0.0.1:9000

The tree looks like ImageNet's training set: ``train/nXXXXXXXX/nXXXXXXXX_NNNNNNN.JPEG``, file
sizes log-normal around a 110 KB mean (ImageNet's train JPEGs average ~110 KB). The bytes are
pseudo-random (incompressible, like JPEG data) behind a JPEG start-of-image marker.

Everything is a pure function of the seed and the index of the file: :func:`plan_dataset` draws
every path and size up front, and :func:`file_bytes` derives each file's content from its own
seed. So a file can be regenerated alone, a re-run may skip files that already exist, and the
local and S3 copies of one plan hold the same bytes.

This module is bench code: cachefs never imports it. (``cachefs demo`` has its own small
generator so that the CLI does not depend on bench/.)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: WordNet id of ImageNet's first class (tench); class k is named ``n{FIRST_CLASS_ID + k}``.
FIRST_CLASS_ID = 1440764
#: Spread of the log-normal size distribution; ImageNet's train JPEGs have roughly this shape.
SIZE_SIGMA = 0.6
#: Smallest file written: room for the JPEG markers, like the smallest real thumbnails.
MIN_SIZE = 1024
#: A JPEG start-of-image marker followed by a JFIF APP0 segment header.
JPEG_HEADER = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"
#: The JPEG end-of-image marker.
JPEG_TRAILER = b"\xff\xd9"


@dataclass(frozen=True, slots=True)
class FileSpec:
    """One generated file: its path relative to the dataset root, its size, its index."""

    path: str
    size: int
    index: int


@dataclass(frozen=True, slots=True)
class DatasetPlan:
    """Every file of a generated dataset, in index order, and the seed their bytes come from."""

    files: tuple[FileSpec, ...]
    seed: int

    @property
    def total_bytes(self) -> int:
        return sum(spec.size for spec in self.files)


def plan_dataset(
    files: int = 10_000, *, classes: int = 100, mean_size: int = 110_000, seed: int = 0
) -> DatasetPlan:
    """Paths and sizes of ``files`` files spread round-robin over ``classes`` class directories.

    Sizes are log-normal with mean ``mean_size`` (before the MIN_SIZE floor, which moves the mean
    by far less than 1 % for the default).
    """
    if files < 1:
        raise ValueError(f"files must be at least 1, got {files}")
    if classes < 1:
        raise ValueError(f"classes must be at least 1, got {classes}")
    if mean_size < MIN_SIZE:
        raise ValueError(f"mean_size must be at least {MIN_SIZE} bytes, got {mean_size}")
    sizes = random.Random(f"cachefs-bench-sizes/{seed}")
    # E[lognormal(mu, sigma)] = exp(mu + sigma²/2): choose mu so the mean is mean_size.
    mu = math.log(mean_size) - SIZE_SIGMA**2 / 2
    specs = []
    for index in range(files):
        class_dir = f"n{FIRST_CLASS_ID + index % classes:08d}"
        size = max(MIN_SIZE, round(sizes.lognormvariate(mu, SIZE_SIGMA)))
        path = f"train/{class_dir}/{class_dir}_{index:07d}.JPEG"
        specs.append(FileSpec(path, size, index))
    return DatasetPlan(tuple(specs), seed)


def file_bytes(spec: FileSpec, seed: int) -> bytes:
    """The content of one file: JPEG markers around bytes drawn from the file's own seed."""
    body = random.Random(f"cachefs-bench-bytes/{seed}/{spec.index}").randbytes(
        spec.size - len(JPEG_HEADER) - len(JPEG_TRAILER)
    )
    return JPEG_HEADER + body + JPEG_TRAILER


def write_local(root: str, plan: DatasetPlan, *, threads: int = 2, exact: bool = False) -> int:
    """Write the plan under ``root``; return how many files were (re)written.

    A file that already exists with the planned size is kept, so re-running is cheap; pass a
    fresh directory (or delete the old one) after changing the seed. ``exact`` (for a directory
    the caller owns) also deletes every other file under ``root``: a benchmark re-run in its
    work directory with fewer files must not serve the earlier run's extra ones.
    """
    if exact:
        _delete_unplanned(root, {os.path.normpath(spec.path) for spec in plan.files})
    for class_dir in sorted({os.path.dirname(spec.path) for spec in plan.files}):
        os.makedirs(os.path.join(root, class_dir), exist_ok=True)

    def write(spec: FileSpec) -> bool:
        path = os.path.join(root, spec.path)
        try:
            if os.stat(path).st_size == spec.size:
                return False
        except FileNotFoundError:
            pass
        temporary = f"{path}.partial"
        with open(temporary, "wb") as out:
            out.write(file_bytes(spec, plan.seed))
        os.replace(temporary, path)  # never leave a short file that a re-run would keep
        return True

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(write, plan.files))


def _delete_unplanned(root: str, planned: set[str]) -> None:
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.relpath(path, root) not in planned:
                os.unlink(path)


def upload_s3(s3_client, bucket: str, prefix: str, plan: DatasetPlan, *, threads: int = 8) -> int:
    """PUT every file of the plan as ``prefix + path`` into ``bucket``; return the bytes sent.

    ``s3_client`` is a boto3 S3 client (thread-safe); the bucket must exist.
    """

    def put(spec: FileSpec) -> int:
        s3_client.put_object(
            Bucket=bucket, Key=prefix + spec.path, Body=file_bytes(spec, plan.seed)
        )
        return spec.size

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(put, plan.files))


def size_summary(sizes: Iterable[int]) -> dict[str, float]:
    """count, mean, median, min and max of a collection of file sizes (for reports)."""
    ordered = sorted(sizes)
    if not ordered:
        raise ValueError("no sizes to summarise")
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "median": median,
        "min": ordered[0],
        "max": ordered[-1],
    }


def _split_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket: write s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.datagen", description=__doc__)
    parser.add_argument("target", help="a local directory, or s3://bucket/prefix")
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--mean-size", type=int, default=110_000, help="bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--endpoint", help="S3 endpoint URL (for s3:// targets)")
    parser.add_argument("--threads", type=int, default=8, help="concurrent writes or PUTs")
    args = parser.parse_args(argv)

    plan = plan_dataset(args.files, classes=args.classes, mean_size=args.mean_size, seed=args.seed)
    if args.target.startswith("s3://"):
        import boto3  # only S3 targets need it

        bucket, prefix = _split_s3_uri(args.target)
        client = boto3.client("s3", endpoint_url=args.endpoint)
        sent = upload_s3(client, bucket, prefix, plan, threads=args.threads)
        print(f"uploaded {len(plan.files)} objects, {sent} bytes, to {args.target}")
    else:
        written = write_local(args.target, plan, threads=args.threads)
        print(
            f"{args.target}: {len(plan.files)} files, {plan.total_bytes} bytes "
            f"({written} written, {len(plan.files) - written} already there)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
