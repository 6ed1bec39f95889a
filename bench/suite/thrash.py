"""The thrash workload: a dataset larger than the RAM tier, read in shuffled epochs.

A ``cachefs up`` worker gets a RAM tier of ``cache_bytes`` (less than the dataset) and one
admission policy. Every epoch drops the page cache and reads every file once, in a new shuffled
order, so every read reaches the worker; its own counters say how many blocks were hits. With
``lru`` a shuffled scan larger than the cache evicts what the next epoch needs (hit ratio well
below capacity/size); ``avoid-eviction`` keeps what it admitted, so about capacity/size of each
later epoch hits.
"""

from __future__ import annotations

import hashlib
import os
import random

from bench.datagen import DatasetPlan, file_bytes
from bench.read_bench import WorkerProcess, drop_page_cache, read_pass
from cachefs.protocol import DEFAULT_BLOCK_SIZE

#: Files whose sha256 every epoch checks (all lengths are always checked).
SAMPLE_FILES = 50
#: The target: avoid-eviction's later epochs hit at least this share of capacity/size.
AVOID_EVICTION_TARGET = 0.9


def measure_thrash(
    *,
    plan: DatasetPlan,
    dataset_spec: dict,
    env: dict[str, str],
    workdir: str,
    admission: str,
    cache_bytes: int,
    epochs: int = 3,
    readers: int = 4,
    order_seed: int = 0,
) -> dict:
    """Run ``epochs`` shuffled epochs over ``plan`` (served as ``dataset_spec``) on a fresh
    worker with a ``cache_bytes`` RAM tier and ``admission``; hit ratio per epoch."""
    os.makedirs(workdir, exist_ok=True)
    worker = WorkerProcess(
        workdir,
        ram=str(cache_bytes),
        env=env,
        extra_args=["--admission", admission],
        ram_dir=f"/dev/shm/cachefs-thrash-{os.getpid()}-{admission}",
    )
    try:
        worker.client.add_dataset(dataset_spec)
        root = os.path.join(worker.mount, dataset_spec["name"])
        epoch_results = [
            run_epoch(worker, plan, root, epoch, readers, order_seed)
            for epoch in range(1, epochs + 1)
        ]
    finally:
        worker.stop()
    dataset_bytes = plan.total_bytes
    later = [e["hit_ratio"] for e in epoch_results[1:]]
    return {
        "admission": admission,
        "cache_bytes": cache_bytes,
        "dataset_bytes": dataset_bytes,
        "capacity_ratio": cache_bytes / dataset_bytes,
        "block_note": block_note(plan, dataset_spec.get("block_size", DEFAULT_BLOCK_SIZE)),
        "epochs": epoch_results,
        "steady_hit_ratio": sum(later) / len(later) if later else None,
    }


def run_epoch(
    worker: WorkerProcess, plan: DatasetPlan, root: str, epoch: int, readers: int, order_seed: int
) -> dict:
    """Read every file once in this epoch's order, page cache dropped first, verified."""
    paths = [os.path.join(root, spec.path) for spec in plan.files]
    sizes = [spec.size for spec in plan.files]
    order = list(range(len(paths)))
    random.Random(f"thrash/{order_seed}/{epoch}").shuffle(order)
    drop_page_cache()
    before = worker.counters()
    run = read_pass(paths, sizes, order, readers, sample_sha256(plan, order_seed))
    after = worker.counters()
    worker.check_alive()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    # Cache hits are the tiers' (RAM, SSD); "recent" is the read-through buffer that serves the
    # rest of a block just fetched and not admitted: counted apart, as neither hit nor miss.
    hits = sum(n for k, n in delta.items() if k.startswith("hits_") and k != "hits_recent")
    recent = delta.get("hits_recent", 0)
    misses = delta["misses"]
    return {
        "epoch": epoch,
        "hits": hits,
        "recent": recent,
        "misses": misses,
        # Every file here is one block, fetched at most once per epoch: a file missed iff it
        # cost a miss. (Counting requests instead would count a file read in two FUSE READs
        # twice.)
        "hit_ratio": 1 - misses / run.files if run.files else 0.0,
        "files_per_s": run.files / run.seconds,
        "store_gets": after["store_gets"] - before["store_gets"],
        "cached_bytes": sum(tier["used"] for tier in worker.client.status()["tiers"]),
    }


def sample_sha256(plan: DatasetPlan, seed: int) -> dict[int, str]:
    """The sha256 of a fixed sample of files, from the generator."""
    picks = random.Random(seed).sample(range(len(plan.files)), min(SAMPLE_FILES, len(plan.files)))
    return {i: hashlib.sha256(file_bytes(plan.files[i], plan.seed)).hexdigest() for i in picks}


def block_note(plan: DatasetPlan, block_size: int) -> str:
    """What one hit or miss is: a block, which is a whole file when files are below the block
    size (then hits + misses per epoch = files read)."""
    largest = max(spec.size for spec in plan.files)
    if largest <= block_size:
        return (
            f"every file (largest {largest:,} B) fits in one {block_size >> 10} KiB block: "
            "hits and misses count files"
        )
    return f"hits and misses count {block_size >> 10} KiB blocks; files up to {largest:,} B"


def evaluate_thrash(results_by_policy: dict[str, dict]) -> list[dict]:
    """Target rows: avoid-eviction's steady hit ratio against capacity/size (>= 0.9), and the
    same ratio for lru, for information only (threshold 0)."""
    rows = []
    for policy, threshold, judged in (
        ("avoid-eviction", AVOID_EVICTION_TARGET, f">= {AVOID_EVICTION_TARGET} x capacity/size"),
        ("lru", 0.0, "x capacity/size (informational, no target)"),
    ):
        run = results_by_policy.get(policy)
        if not run or run.get("steady_hit_ratio") is None:
            continue
        value = run["steady_hit_ratio"] / run["capacity_ratio"]
        epochs = len(run["epochs"])
        rows.append(
            {
                "target": f"thrash: {policy} hit ratio in epochs 2-{epochs} {judged}",
                "value": value,
                "threshold": threshold,
                "unit": "x capacity/size",
                "met": value >= threshold,
            }
        )
    return rows
