"""P3's algorithm steps against small cases worked out by hand from the paper's formulas.

The profile is ``LINEAR``: sPR = 1000 samples/s per GPU whatever the batch (equation (7) with
k1 = k2 = 0), γ = 0.02, λ = 4, v = 0. A task of 3.6e6 samples therefore takes 3600 s on one GPU.
Every expected number below is computed in the test from the equations, not by the code under
test.
"""

from __future__ import annotations

import pytest
from sched_builders import LINEAR, cluster, job

from coordinator.scheduling.model import (
    ClusterState,
    JobSpec,
    JobState,
    ModelProfile,
    QosClass,
    Start,
    Wait,
)
from coordinator.scheduling.perf import comm_penalty, compute_seconds, estimated_rate
from coordinator.scheduling.qos import (
    CapacityPolicy,
    MinMinPolicy,
    QosPolicy,
    TetrisPolicy,
    WeightedFairPolicy,
    capacities,
    expected_completion,
    fit_quadratic_throughput,
    placement_cost,
)

GAMMA, LAMBDA, PER_GPU = 0.02, 4.0, 1000.0
SAMPLES = 3.6e6


def pr(nodes: int, per_node: int) -> float:
    """Equations (5) and (8): (d_node·d_g − γ·((d_g − 1) + λ·(d_node − 1)·d_g))·sPR."""
    comm = GAMMA * ((per_node - 1) + LAMBDA * (nodes - 1) * per_node)
    return (nodes * per_node - comm) * PER_GPU


def cost(nodes: int, per_node: int, all_nodes: int, gpus_per_node: int, theta: float) -> float:
    """Equation (10) as we read it: GPUs used / all GPUs + θ · nodes used / all nodes."""
    return nodes * per_node / (all_nodes * gpus_per_node) + theta * nodes / all_nodes


def starts(decisions: list) -> dict[str, dict[str, int]]:
    return {d.job_id: dict(d.placement) for d in decisions if isinstance(d, Start)}


# --- the model: equations (4), (5), (7), (8) ----------------------------------------------------


def test_throughput_and_time_follow_equations_4_5_and_8() -> None:
    task = job("t", samples=SAMPLES)
    two_by_four = {"a": 4, "b": 4}
    # Comm(⟨2,4⟩) = 0.02 · (3 + 4 · 1 · 4) = 0.38 GPUs lost; PR = 7.62 · 1000.
    assert comm_penalty(two_by_four, GAMMA, LAMBDA) == pytest.approx(0.38)
    assert estimated_rate(task, two_by_four) == pytest.approx(7620.0)
    assert estimated_rate(task, two_by_four) == pytest.approx(pr(2, 4))
    # L = w_bat·w_iter / PR + v, with v = 5 s here.
    with_startup = ModelProfile(
        "v5", (PER_GPU, 0.0, 0.0), comm_gamma=GAMMA, comm_lambda=LAMBDA, startup_s=5.0
    )
    spec = job("t", samples=SAMPLES, profile=with_startup)
    assert compute_seconds(spec, two_by_four, SAMPLES) == pytest.approx(SAMPLES / 7620.0 + 5.0)


def test_per_gpu_throughput_is_the_quadratic_of_the_local_batch() -> None:
    # Equation (7) with k0 = 100, k1 = 2, k2 = −0.01; global batch 64 on 4 GPUs: local 16,
    # sPR = 100 + 32 − 2.56 = 129.44; no communication cost (γ = 0).
    profile = ModelProfile("q", (100.0, 2.0, -0.01))
    spec = JobSpec("q", 0.0, 1, profile, 1.0, 1, batch_size=64, batch_per_gpu=False)
    assert estimated_rate(spec, {"a": 4}) == pytest.approx(4 * 129.44)
    fitted = fit_quadratic_throughput(
        [(x, 100 + 2 * x - 0.01 * x * x) for x in (4, 8, 16, 32)], relative=True
    )
    assert fitted == pytest.approx((100.0, 2.0, -0.01))


# --- ECT (9), cost (10), CER (11) -----------------------------------------------------------


def test_ect_is_arrival_plus_a_multiple_of_the_one_gpu_time_and_zero_for_urgent() -> None:
    assert expected_completion(job("u", arrival=50.0, qos=QosClass.URGENT)) == 50.0
    assert expected_completion(job("p", arrival=50.0, qos=QosClass.PRIOR)) == pytest.approx(3650.0)
    assert expected_completion(job("n", arrival=50.0)) == pytest.approx(50.0 + 7200.0)
    prior = job("p", arrival=50.0, qos=QosClass.PRIOR)
    assert expected_completion(prior, prior_multiple=1.5) == pytest.approx(50.0 + 5400.0)


def test_cost_and_cer_of_every_shape_on_two_nodes_of_four() -> None:
    state = cluster({"n1": 4, "n2": 4})
    assert placement_cost({"n1": 4, "n2": 4}, state, 0.5) == pytest.approx(8 / 8 + 0.5 * 2 / 2)
    options = QosPolicy(theta=0.5).options(JobState(job("t", samples=SAMPLES, max_gpus=8)), state)
    by_shape = {o.shape: o for o in options}
    assert set(by_shape) == {(n, g) for n in (1, 2) for g in (1, 2, 3, 4)}
    for (nodes, per_node), option in by_shape.items():
        assert option.rate == pytest.approx(pr(nodes, per_node))
        assert option.seconds == pytest.approx(SAMPLES / pr(nodes, per_node))
        assert option.cer == pytest.approx(pr(nodes, per_node) / cost(nodes, per_node, 2, 4, 0.5))
    # The highest CER: ⟨1,4⟩, 3940 / 0.75 = 5253 (⟨2,4⟩: 7620 / 1.5 = 5080).
    assert max(options, key=lambda o: o.cer).shape == (1, 4)


# --- placement choice (15), slack (16), dispatch ------------------------------------------------


def test_a_task_takes_the_best_cer_among_placements_meeting_its_ect() -> None:
    # Prior, arrival 0: e = 3600. At now = 3000 only L ≤ 600 s meets it: ⟨2,4⟩ (472 s) does,
    # ⟨1,4⟩ (914 s, the higher CER) does not. So ⟨2,4⟩, slack 3600 − (3000 + 472.4).
    prior = JobState(job("p", samples=SAMPLES, qos=QosClass.PRIOR, max_gpus=8))
    slack, chosen = QosPolicy().plan(prior, cluster({"n1": 4, "n2": 4}, now=3000.0))
    assert chosen.shape == (2, 4)
    assert slack == pytest.approx(3600.0 - (3000.0 + SAMPLES / pr(2, 4)))
    # At now = 0 every placement of ≥ 1 GPU meets 3600 s: the highest CER, ⟨1,4⟩.
    slack0, chosen0 = QosPolicy().plan(prior, cluster({"n1": 4, "n2": 4}))
    assert chosen0.shape == (1, 4)
    assert slack0 == pytest.approx(3600.0 - SAMPLES / pr(1, 4))


def test_an_urgent_task_meets_nothing_and_takes_the_highest_cer_with_negative_slack() -> None:
    urgent = JobState(job("u", samples=SAMPLES, arrival=2900.0, qos=QosClass.URGENT, max_gpus=8))
    slack, chosen = QosPolicy().plan(urgent, cluster({"n1": 4, "n2": 4}, now=3000.0))
    assert chosen.shape == (1, 4)
    assert slack == pytest.approx(2900.0 - (3000.0 + SAMPLES / pr(1, 4)))


def test_dispatch_in_slack_order_stops_at_the_first_task_that_does_not_fit() -> None:
    # now = 3000 on 2 x 4 GPUs. Slacks: urgent U (arrival 2900) −1013.7 with ⟨1,4⟩; prior P
    # 127.6 with ⟨2,4⟩; normal N (e = 7200) 7200 − 3913.7 with ⟨1,4⟩. U takes a node; P
    # needs both nodes and does not fit; the dispatch stops there, so N waits although its
    # ⟨1,4⟩ would fit the other node (the paper: "直到當前資源無法滿足執行需求").
    waiting = (
        JobState(job("N", samples=SAMPLES, max_gpus=8)),
        JobState(job("P", samples=SAMPLES, qos=QosClass.PRIOR, max_gpus=8)),
        JobState(job("U", samples=SAMPLES, arrival=2900.0, qos=QosClass.URGENT, max_gpus=8)),
    )
    state = cluster({"n1": 4, "n2": 4}, now=3000.0, waiting=waiting)
    decisions = QosPolicy().schedule(state)
    assert starts(decisions) == {"U": {"n1": 4}}
    assert {d.job_id for d in decisions if isinstance(d, Wait)} == {"P", "N"}
    # Our backfilling variant re-plans P on the free node instead (⟨1,4⟩: nothing meets its
    # ECT there, so its highest CER) and N, next, finds nothing left.
    assert starts(QosPolicy(backfill=True).schedule(state)) == {
        "U": {"n1": 4},
        "P": {"n2": 4},
    }


def test_placements_come_from_the_whole_cluster_not_the_free_gpus() -> None:
    # Only 2 GPUs free, nothing else waiting: the task's choice is still ⟨1,4⟩ (highest CER of
    # M_i), which does not fit, so it waits rather than shrinking to what is free.
    state = cluster(
        {"n1": 2, "n2": 0},
        waiting=(JobState(job("N", samples=SAMPLES, max_gpus=8)),),
    )
    assert starts(QosPolicy().schedule(state)) == {}
    assert QosPolicy().place(job("N", samples=SAMPLES, max_gpus=8), state) is None


# --- the baselines as the paper defines them ----------------------------------------------------


def _one_slot(*jobs: JobSpec) -> ClusterState:
    """Each job asks 4 GPUs of a single free node of 4: the one started is the queue's head."""
    return cluster({"n1": 4}, now=4000.0, waiting=tuple(JobState(j) for j in jobs))


def test_min_min_runs_the_earliest_ect_and_weighted_fair_the_smallest_weighted_value() -> None:
    # D: arrival 0, Prior, 3600 s on one GPU: e = 3600; α = ½: ½·0 + ½·3600 = 1800.
    # E: arrival 3000, Urgent: e = 3000; ½·3000 + ½·3000 = 3000.
    # F: arrival 0, Normal, 36000 s: e = 72000; ½·72000 = 36000.
    d = job("D", 4, samples=SAMPLES, qos=QosClass.PRIOR)
    e = job("E", 4, samples=SAMPLES, arrival=3000.0, qos=QosClass.URGENT)
    f = job("F", 4, samples=10 * SAMPLES)
    assert list(starts(MinMinPolicy().schedule(_one_slot(d, e, f)))) == ["E"]  # 3000 < 3600
    assert list(starts(WeightedFairPolicy().schedule(_one_slot(d, e, f)))) == ["D"]  # 1800
    # All weight on the arrival is FIFO: F (arrival 0) before E (3000).
    only_arrival = WeightedFairPolicy(arrival_weight=1.0)
    assert list(starts(only_arrival.schedule(_one_slot(f, e)))) == ["F"]
    # Both give what the user asked, and the head that does not fit stops the queue.
    big = job("big", 8, samples=SAMPLES, qos=QosClass.URGENT)
    small = job("small", 1, samples=SAMPLES)
    assert starts(MinMinPolicy().schedule(_one_slot(big, small))) == {}


def test_capacity_shares_round_by_largest_remainder() -> None:
    # 16 GPUs at 5/35/60 %: 0.8, 5.6, 9.6 -> 0, 5, 9 and two left: the queue with none first,
    # then the larger remainder (Prior's and Normal's are both 0.6; Prior is listed first).
    assert capacities({"urgent": 0.05, "prior": 0.35, "normal": 0.60}, 16) == {
        "urgent": 1,
        "prior": 6,
        "normal": 9,
    }
    # Six equal types: 16/6 = 2.67 each -> 2 each and the 4 left to the first four.
    six = capacities(dict.fromkeys("abcdef", 1.0), 16)
    assert six == {"a": 3, "b": 3, "c": 3, "d": 3, "e": 2, "f": 2}


def test_capacity_never_borrows_and_caps_a_request_at_its_queue() -> None:
    # 8 GPUs, QoS shares: urgent 1 (0.4 -> 0, gets one of the two left), prior 3, normal 4.
    running = (JobState(job("r", 4), {"n1": 4}),)  # Normal holds its whole capacity
    waiting = (JobState(job("n", 1)), JobState(job("p", 4, qos=QosClass.PRIOR)))
    state = cluster({"n1": 0, "n2": 4}, running=running, waiting=waiting)
    decisions = CapacityPolicy().schedule(state)
    # n waits although 4 GPUs are free (no borrowing); p asked 4, Prior's capacity is 3.
    assert starts(decisions) == {"p": {"n2": 3}}
    assert any(isinstance(d, Wait) and d.job_id == "n" for d in decisions)


def test_tetris_demands_are_the_highest_pr_or_highest_cer_placement() -> None:
    state = cluster({"n1": 4, "n2": 4})
    task = JobState(job("t", samples=SAMPLES, max_gpus=8))
    assert TetrisPolicy(term="perf").demand(task, state).shape == (2, 4)
    assert TetrisPolicy(term="cer").demand(task, state).shape == (1, 4)


def test_tetris_packs_by_alignment_plus_shortest_time() -> None:
    # Free: n1 4, n2 2. A may use 1 GPU, B 2 (their highest-PR placements: ⟨1,1⟩, ⟨1,2⟩).
    # Score = alignment on the node with most free GPUs (n1) + fastest L / own L.
    a = JobState(job("A", samples=SAMPLES, max_gpus=1))
    b = JobState(job("B", samples=SAMPLES, max_gpus=2))
    state = cluster({"n1": 4, "n2": 2}, waiting=(a, b))
    policy = TetrisPolicy(term="perf")
    time_a, time_b = SAMPLES / pr(1, 1), SAMPLES / pr(1, 2)
    fastest = min(time_a, time_b)
    score_a = 1 * 4 / (1 * 4) + fastest / time_a
    score_b = 2 * 4 / (2 * 4) + fastest / time_b
    assert score_b > score_a
    decisions = policy.schedule(state)
    # B first on n1 (the most free GPUs); then A on n1's remaining 2 (2 free) or n2 (2 free):
    # equal alignment, n1 by name.
    assert [d.job_id for d in decisions if isinstance(d, Start)] == ["B", "A"]
    assert starts(decisions) == {"B": {"n1": 2}, "A": {"n1": 1}}


def test_linear_profile_is_what_the_hand_numbers_assume() -> None:
    assert LINEAR.throughput_coeffs == (PER_GPU, 0.0, 0.0)
    assert (LINEAR.comm_gamma, LINEAR.comm_lambda, LINEAR.startup_s) == (GAMMA, LAMBDA, 0.0)
