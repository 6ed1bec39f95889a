"""The thrash workload: target rows from known numbers, and one real small run per policy."""

from __future__ import annotations

import os

import pytest

from bench.datagen import plan_dataset, write_local
from bench.suite.thrash import evaluate_thrash, measure_thrash

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (FUSE, drop_caches)")

FILES = 200
EPOCHS = 2


def policy_result(steady: float, capacity: float) -> dict:
    return {
        "capacity_ratio": capacity,
        "steady_hit_ratio": steady,
        "epochs": [{"epoch": n} for n in (1, 2, 3)],
    }


def test_evaluate_thrash_compares_steady_hit_ratio_with_capacity():
    rows = evaluate_thrash(
        {"avoid-eviction": policy_result(0.45, 0.5), "lru": policy_result(0.1, 0.5)}
    )
    avoid, lru = rows
    assert avoid["value"] == pytest.approx(0.9)
    assert avoid["threshold"] == 0.9
    assert avoid["met"] is True
    assert "avoid-eviction" in avoid["target"] and "2-3" in avoid["target"]
    assert lru["value"] == pytest.approx(0.2)
    assert lru["threshold"] == 0 and "informational" in lru["target"]

    below = evaluate_thrash({"avoid-eviction": policy_result(0.40, 0.5)})
    assert len(below) == 1 and below[0]["value"] == pytest.approx(0.8) and not below[0]["met"]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    plan = plan_dataset(FILES, classes=10, seed=3)
    source = tmp_path_factory.mktemp("thrash-source")
    write_local(str(source), plan)
    return plan, str(source)


@pytest.mark.parametrize("policy", ["avoid-eviction", "lru"])
def test_measure_thrash_small_run(small_dataset, tmp_path, policy):
    plan, source = small_dataset
    cache_bytes = plan.total_bytes // 2
    result = measure_thrash(
        plan=plan,
        dataset_spec={"name": "small", "uri": f"file://{source}"},
        env={},
        workdir=str(tmp_path / "work"),
        admission=policy,
        cache_bytes=cache_bytes,
        epochs=EPOCHS,
        readers=4,
    )
    assert result["admission"] == policy
    assert result["dataset_bytes"] == plan.total_bytes
    assert result["capacity_ratio"] == pytest.approx(cache_bytes / plan.total_bytes)
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for epoch in epochs:
        # A file that did not miss was served by hits (a "recent" hit: the second READ of a
        # file that missed and was not admitted). Every miss is one GET of the store.
        assert epoch["misses"] <= FILES
        assert epoch["hits"] + epoch["recent"] >= FILES - epoch["misses"]
        assert epoch["store_gets"] == epoch["misses"]
        assert epoch["hit_ratio"] == pytest.approx(1 - epoch["misses"] / FILES)
        assert 0 < epoch["cached_bytes"] <= cache_bytes
    # Every file's first read reaches the store. (Not "no hits": a file whose pages the page
    # cache dropped between two of its READs — memory pressure, drop_caches by another process —
    # is read again, and under lru that second READ hits the block its first READ admitted.)
    assert epochs[0]["misses"] == FILES
    assert result["steady_hit_ratio"] == epochs[1]["hit_ratio"]
    if policy == "avoid-eviction":
        assert epochs[1]["hit_ratio"] >= 0.5 * result["capacity_ratio"]
