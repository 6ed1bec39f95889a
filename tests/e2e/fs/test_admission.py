"""Cache admission through the mount: a dataset twice the RAM tier, read for 3 shuffled epochs.

avoid-eviction keeps what it admitted in epoch 1 and reads the rest through, so every later epoch
hits ~capacity/size of its blocks; lru evicts what the next epoch needs and collapses (the cache
thrashing P1 and CoorDL report). Real worker processes, real mount, local (file://) source.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.worker_process import WorkerProcess, drop_page_cache

FILE_SIZE = 64 * 1024  # one block per file (block size 64 KiB below)
FILES = 64  # 4 MiB of data
RAM = "2MiB"  # half the dataset


def epoch_hit_ratios(worker: WorkerProcess, names: list[str], epochs: int = 3) -> list[float]:
    rng = random.Random(42)
    ratios = []
    for _ in range(epochs):
        order = names[:]
        rng.shuffle(order)
        drop_page_cache()  # every read must reach the worker
        before = worker.status()["reads"]
        for name in order:
            with open(worker.path("ds", name), "rb") as f:
                assert len(f.read()) == FILE_SIZE
        after = worker.status()["reads"]
        # Tier hits only; "recent" (the read-through buffer) is a request, not a cache hit.
        tier_hits = sum(after["hits"][t] - before["hits"][t] for t in ("ram", "ssd"))
        requests = sum(after["hits"].values()) - sum(before["hits"].values())
        requests += after["misses"] - before["misses"]
        ratios.append(tier_hits / requests)
    return ratios


@pytest.fixture
def source_dir(tmp_path):
    rng = random.Random(3)
    root = tmp_path / "source"
    root.mkdir()
    for i in range(FILES):
        (root / f"f{i:03d}.bin").write_bytes(rng.randbytes(FILE_SIZE))
    return root


def run_policy(
    tmp_path, source_dir, admission: str, ram_reserve: str = "0"
) -> tuple[list[float], dict]:
    worker = WorkerProcess(
        str(tmp_path / admission), ram=RAM, admission=admission, ram_reserve=ram_reserve
    ).start()
    try:
        worker.add_dataset("ds", f"file://{source_dir}", block_size=FILE_SIZE)
        ratios = epoch_hit_ratios(worker, sorted(os.listdir(source_dir)))
        return ratios, worker.status()
    finally:
        worker.cleanup()


def test_avoid_eviction_keeps_a_stable_hit_ratio_and_lru_thrashes(tmp_path, source_dir):
    capacity_over_size = 0.5
    avoid, avoid_status = run_policy(tmp_path, source_dir, "avoid-eviction")
    lru, lru_status = run_policy(tmp_path, source_dir, "lru")
    assert avoid[0] == 0.0 and lru[0] == 0.0  # cold
    for ratio in avoid[1:]:
        assert ratio >= 0.9 * capacity_over_size, avoid
    assert max(lru[1:]) < 0.9 * capacity_over_size, lru
    assert avoid_status["cache"]["evicted"] == 0
    assert avoid_status["cache"]["refused"] > 0
    assert lru_status["cache"]["evicted"] > 0
    for status in (avoid_status, lru_status):
        ram = status["tiers"][0]
        assert ram["used"] <= ram["capacity"]
