"""P4's Roofline numbers and allocation search."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_builders import cluster, job

from coordinator.scheduling.model import ClusterState, ModelProfile, Node, SchedulingError
from coordinator.scheduling.roofline import (
    ModelCost,
    RooflinePolicy,
    Worker,
    attainable_flops,
    best_allocation,
    candidate_sets,
    predict,
)

ALEXNET = ModelCost(flops=334e6, memory_bytes=289e6)
GTX1080 = Worker("gtx1080", 1, 8.873e12, 352e9, 100e6, 3.0)
GTX970 = Worker("gtx970", 1, 3.92e12, 224e9, 100e6, 4.0)
HARDWARE = [(8.873e12, 352e9), (3.92e12, 224e9), (15.7e12, 900e9)]


def test_alexnet_numbers_from_p4() -> None:
    assert ALEXNET.intensity == pytest.approx(1.16, abs=0.005)
    # The paper rounds I to 1.16 FLOP/B: GTX 1080 (β = 352 GB/s) attains 408.32 GFLOP/s,
    # far below its 8.87 TFLOP/s peak: AlexNet is memory-bound there.
    assert attainable_flops(8.873e12, 352e9, 1.16) == pytest.approx(408.32e9)
    assert attainable_flops(1e9, 352e9, 1.16) == 1e9  # compute-bound when π is low


def test_single_sync_and_async_predictions() -> None:
    single = predict(ALEXNET, [GTX1080], 60_000)
    tau = 3 * 334e6 * 60_000 / (352e9 * ALEXNET.intensity)
    assert single.mode == "single" and single.seconds == pytest.approx(tau + 3.0)
    # Two identical GPUs: no variance, synchronous, half the work each plus one model transfer.
    pair = predict(ALEXNET, [GTX970, dataclasses.replace(GTX970, name="gtx970-b")], 60_000)
    transfer = 8 * 289e6 / 100e6
    half = 3 * 334e6 * 30_000 / (224e9 * ALEXNET.intensity)
    assert pair.mode == "sync" and pair.seconds == pytest.approx(half + transfer + 4.0)
    # A GTX 1080 with a GTX 970: their speeds differ by ~45 %, so asynchronous.
    assert predict(ALEXNET, [GTX1080, GTX970], 60_000).mode == "async"


def test_best_allocation_switches_with_communication() -> None:
    workers = [GTX1080, GTX970, dataclasses.replace(GTX970, name="gtx970-b")]
    rare_syncs = best_allocation(ALEXNET, workers, 600_000, syncs=1)
    frequent_syncs = best_allocation(ALEXNET, workers, 600_000, syncs=100)
    assert len(rare_syncs.workers) == 3
    assert frequent_syncs.workers == ("gtx1080",)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(HARDWARE), min_size=2, max_size=5),
    st.floats(1e3, 1e6),
    st.floats(0.5, 50),
)
def test_pruned_search_is_exact_for_identical_networks_when_synchronous(
    hardware: list[tuple[float, float]], samples: float, syncs: float
) -> None:
    """Above the exhaustive limit the per-size best sets must find the synchronous optimum."""
    workers = [Worker(f"w{i}", 1, pi, beta, 1e9, 2.0) for i, (pi, beta) in enumerate(hardware)]
    exhaustive = min(
        predict(ALEXNET, subset, samples, syncs=syncs, async_cv=1e9).seconds
        for size in range(1, len(workers) + 1)
        for subset in itertools.combinations(workers, size)
    )
    pruned_sets = candidate_sets(
        ALEXNET, workers, samples, sync_bytes=None, syncs=syncs, exhaustive_limit=0
    )
    pruned = min(
        predict(ALEXNET, subset, samples, syncs=syncs, async_cv=1e9).seconds
        for subset in pruned_sets
    )
    assert pruned == pytest.approx(exhaustive)
    assert len(pruned_sets) <= 2 * len(workers)


def test_policy_places_on_the_fastest_node_set_and_names_missing_facts() -> None:
    profile = ModelProfile("alexnet", (1.0, 0.0, 0.0), forward_flops=334e6, memory_bytes=289e6)
    nodes = {
        "fast": Node("fast", 1, 1, 8.873e12, 352e9, 100e6, 3.0),
        "slow": Node("slow", 1, 1, 3.92e12, 224e9, 100e6, 4.0),
    }
    state = ClusterState(0.0, nodes)
    choice = RooflinePolicy().place(job("j", 1, profile=profile, max_gpus=2), state)
    assert choice is not None and choice.placement == {"fast": 1}
    with pytest.raises(SchedulingError, match="forward_flops"):
        RooflinePolicy().place(job("j", 1), state)
    with pytest.raises(SchedulingError, match="peak_flops"):
        RooflinePolicy().place(job("j", 1, profile=profile), cluster({"bare": 1}))
