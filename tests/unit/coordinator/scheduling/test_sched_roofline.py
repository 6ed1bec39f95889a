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
    layer_flops,
    layer_memory_bytes,
    predict,
    sort_by_compute,
    sync_or_async,
)

ALEXNET = ModelCost(flops=334e6, memory_bytes=289e6)
#: P4 section 4.1: GTX 1080 π = 6.1 TFLOP/s, β = 352 GB/s; GTX 970 π = 5.2 TFLOP/s, β = 232 GB/s.
GTX1080 = Worker("gtx1080", 1, 6.1e12, 352e9, 100e6, 3.0)
GTX970 = Worker("gtx970", 1, 5.2e12, 232e9, 100e6, 4.0)
HARDWARE = [(6.1e12, 352e9), (5.2e12, 232e9), (15.7e12, 900e9)]
#: A model of intensity 1 FLOP/B, for round hand computations.
UNIT = ModelCost(flops=1e9, memory_bytes=1e9)


def test_alexnet_numbers_from_p4() -> None:
    assert ALEXNET.intensity == pytest.approx(1.16, abs=0.005)
    # Section 4.1, with I rounded to 1.16 FLOP/B as the paper does: both GPUs are memory-bound.
    imax_1080, imax_970 = 6.1e12 / 352e9, 5.2e12 / 232e9
    assert imax_1080 == pytest.approx(17.33, abs=0.005)
    assert imax_970 == pytest.approx(22.41, abs=0.005)
    assert attainable_flops(6.1e12, 352e9, 1.16) == pytest.approx(408.32e9)
    assert attainable_flops(5.2e12, 232e9, 1.16) == pytest.approx(269.12e9)
    assert attainable_flops(1e9, 352e9, 1.16) == 1e9  # compute-bound when π is low


def test_layer_costs_reproduce_table_1_rows() -> None:
    """Equations (2) and (3) against P4's Table 1 (FLOPS and memory columns)."""
    assert layer_flops(11, 1, 28, 28, 96) == 9_106_944  # Conv1: 11²·1·28·28·96
    assert layer_flops(5, 96, 14, 14, 256) == 120_422_400  # Conv2
    assert layer_flops(3, 384, 7, 7, 384) == 65_028_096  # Conv4
    assert layer_flops(1, 12544, 1, 1, 4096) == 51_380_224  # Dense1
    # Conv1: 11616 weights + 75264 outputs, float32.
    assert layer_memory_bytes(11, 1, 28, 28, 96) == 4 * (11_616 + 75_264)
    # Maxpool1 has no weights: its 14·14·96 = 18816 outputs only.
    assert layer_memory_bytes(0, 0, 14, 14, 96) == 4 * 18_816


def test_algorithm_1_sorts_by_attainable_compute() -> None:
    slow = Worker("slow", 1, 1e15, 100e9, None, 0.0)  # memory-bound: 100 GFLOP/s at I = 1
    capped = Worker("capped", 1, 50e9, 1e15, None, 0.0)  # compute-bound: π = 50 GFLOP/s
    fast = Worker("fast", 1, 1e15, 400e9, None, 0.0)  # 400 GFLOP/s
    assert [w.name for w in sort_by_compute([fast, slow, capped], UNIT)] == [
        "capped",
        "slow",
        "fast",
    ]


def test_equation_9_transfer_and_equation_16_slowest_node() -> None:
    """Two nodes of 400 and 200 GFLOP/s, 3·10⁹·1000 FLOPs of training split evenly (1.5·10¹²
    each), 2 synchronisations of M = 10⁹ B over 8 Gbit/s (2·8·10⁹/8·10⁹ = 2 s), η = 1 and 0.5.
    Node times: 1.5e12/400e9 + 2 + 1 = 6.75 s and 1.5e12/200e9 + 2 + 0.5 = 10 s: the set takes
    the slower, 10 s."""
    a = Worker("a", 1, 1e15, 400e9, 8e9, 1.0)
    b = Worker("b", 1, 1e15, 200e9, 8e9, 0.5)
    pair = predict(UNIT, [a, b], 1000, syncs=2)
    assert pair.seconds == pytest.approx(10.0)
    # Equation (6): alone, a takes 3e12/400e9 + 1 = 8.5 s and b 3e12/200e9 + 0.5 = 15.5 s.
    assert predict(UNIT, [a], 1000).seconds == pytest.approx(8.5)
    assert predict(UNIT, [b], 1000).seconds == pytest.approx(15.5)


def test_step_7_names_the_mode_after_the_set_is_chosen() -> None:
    """The paper compares times by equation (16) (steps 5-6) and only then picks sync or async
    (step 7). An asynchronous estimate (work split by speed: 3e12/600e9 + 2 + 1 = 8 s) would
    beat a alone (8.5 s) and pick the pair; equation (16) gives the pair 10 s, so a alone wins."""
    a = Worker("a", 1, 1e15, 400e9, 8e9, 1.0)
    b = Worker("b", 1, 1e15, 200e9, 8e9, 0.5)
    pair = predict(UNIT, [a, b], 1000, syncs=2)
    # CV of (400, 200) = 100 / 300 = 0.33 > 0.15: step 7 would train the pair asynchronously,
    # and that does not change its predicted time.
    assert pair.mode == "async" and pair.seconds == pytest.approx(10.0)
    chosen = best_allocation(UNIT, [a, b], 1000, syncs=2)
    assert (chosen.workers, chosen.mode) == (("a",), "single")
    assert chosen.seconds == pytest.approx(8.5)
    assert sync_or_async([300.0, 300.0]) == "sync"
    assert sync_or_async([300.0, 250.0]) == "sync"  # CV = 25/275 = 0.09
    assert sync_or_async([300.0, 200.0]) == "async"  # CV = 50/250 = 0.2


def test_equation_18_tie_goes_to_fewer_nodes() -> None:
    """A pair and a single node predicting the same time: the single node is chosen."""
    a = Worker("a", 1, 1e15, 300e9, None, 0.0)
    b = dataclasses.replace(a, name="b", network_bits_per_s=8e9)
    a = dataclasses.replace(a, network_bits_per_s=8e9)
    # Alone: 3e12/300e9 = 10 s. Pair: 1.5e12/300e9 + 5 syncs·1 s = 10 s.
    chosen = best_allocation(UNIT, [a, b], 1000, syncs=5)
    assert chosen.seconds == pytest.approx(10.0) and chosen.workers == ("a",)


def test_single_sync_and_async_predictions() -> None:
    single = predict(ALEXNET, [GTX1080], 60_000)
    tau = 3 * 334e6 * 60_000 / (352e9 * ALEXNET.intensity)
    assert single.mode == "single" and single.seconds == pytest.approx(tau + 3.0)
    # Two identical GPUs: no variance, synchronous, half the work each plus one model transfer.
    pair = predict(ALEXNET, [GTX970, dataclasses.replace(GTX970, name="gtx970-b")], 60_000)
    transfer = 8 * 289e6 / 100e6
    half = 3 * 334e6 * 30_000 / (232e9 * ALEXNET.intensity)
    assert pair.mode == "sync" and pair.seconds == pytest.approx(half + transfer + 4.0)
    # A GTX 1080 with a GTX 970: 408 vs 269 GFLOP/s, CV 0.21, so asynchronous.
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
        "fast": Node("fast", 1, 1, 6.1e12, 352e9, 100e6, 3.0),
        "slow": Node("slow", 1, 1, 5.2e12, 232e9, 100e6, 4.0),
    }
    state = ClusterState(0.0, nodes)
    choice = RooflinePolicy().place(job("j", 1, profile=profile, max_gpus=2), state)
    assert choice is not None and choice.placement == {"fast": 1}
    with pytest.raises(SchedulingError, match="forward_flops"):
        RooflinePolicy().place(job("j", 1), state)
    with pytest.raises(SchedulingError, match="peak_flops"):
        RooflinePolicy().place(job("j", 1, profile=profile), cluster({"bare": 1}))
