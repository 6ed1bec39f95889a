"""Each policy's decisions on hand-made cluster states."""

from __future__ import annotations

import dataclasses

import pytest
from sched_builders import LINEAR, cluster, job

from coordinator.scheduling import POLICY_NAMES, make_policy
from coordinator.scheduling.baselines import FifoPolicy, RandomPolicy
from coordinator.scheduling.elastic import EarliestFinishPolicy, ElasticPolicy
from coordinator.scheduling.model import (
    Clone,
    Dataset,
    JobState,
    QosClass,
    Resize,
    SchedulingError,
    Start,
    Wait,
)
from coordinator.scheduling.qos import (
    CapacityPolicy,
    QosPolicy,
    expected_completion,
    fit_comm_penalty,
    fit_quadratic_throughput,
    single_gpu_seconds,
)
from coordinator.scheduling.tdcs import TdcsPolicy
from coordinator.scheduling.themis import LasPolicy

GB = 10**9


def starts(decisions: list) -> dict[str, dict[str, int]]:
    return {d.job_id: dict(d.placement) for d in decisions if isinstance(d, Start)}


# --- registry ------------------------------------------------------------------------------


def test_every_registered_name_builds_its_policy() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(SchedulingError, match=r"unknown placement policy 'nope'.*fifo"):
        make_policy("nope")


# --- baselines ----------------------------------------------------------------------------


def test_fifo_is_strict_and_random_is_seeded() -> None:
    state = cluster({"a": 2, "b": 1}, waiting=(JobState(job("big", 4)), JobState(job("small"))))
    decisions = FifoPolicy().schedule(state)
    assert [type(d) for d in decisions] == [Wait, Wait]  # the big head blocks the small job
    one = RandomPolicy(seed=3).place(job("j", 2), cluster({"a": 1, "b": 1, "c": 1}))
    two = RandomPolicy(seed=3).place(job("j", 2), cluster({"a": 1, "b": 1, "c": 1}))
    assert one is not None and two is not None and one.placement == two.placement


def test_fifo_locality_prefers_nodes_holding_the_data() -> None:
    data = {"d": Dataset("d", 10 * GB, {"b": 8 * GB})}
    state = cluster({"a": 4, "b": 4}, datasets=data)
    assert FifoPolicy().place(job("j", 2, dataset="d"), state).placement == {"a": 2}
    choice = FifoPolicy(locality=True).place(job("j", 2, dataset="d"), state)
    assert choice.placement == {"b": 2}
    assert choice.ranking[0].node == "b" and choice.ranking[0].cached_bytes == 8 * GB


# --- P1 TDCS -------------------------------------------------------------------------------


def test_tdcs_takes_copy_nodes_first_then_fills() -> None:
    data = {"d": Dataset("d", 10 * GB, {"c": 5 * GB, "d": 5 * GB})}
    state = cluster({"a": 4, "b": 4, "c": 2, "d": 1}, datasets=data)
    choice = TdcsPolicy().place(job("j", 5, dataset="d"), state)
    # S3 = {c, d}: 3 GPUs there, the other 2 from the node with most free GPUs (a).
    assert choice.placement == {"c": 2, "d": 1, "a": 2}


def test_tdcs_follows_the_papers_steps_for_t2() -> None:
    """P1 section 5.2: D1' is cached on S1 = {n1, n2, n3}; T2's candidates are S2 = {n2, ..., n6}
    (its node selector leaves n1 out); S3 = S1 ∩ S2 = {n2, n3} is taken first, greedily, and
    the rest comes from S2 \\ S3, most free GPUs first (n5, 4 free, before n4 with 2)."""
    cached = {"n1": 3 * GB, "n2": 3 * GB, "n3": 4 * GB}
    data = {"d1": Dataset("d1", 10 * GB, cached)}
    state = cluster({"n1": 4, "n2": 4, "n3": 4, "n4": 2, "n5": 4, "n6": 3}, datasets=data)
    t2 = dataclasses.replace(
        job("t2", 10, dataset="d1"), candidates=frozenset({"n2", "n3", "n4", "n5", "n6"})
    )
    choice = TdcsPolicy().place(t2, state)
    assert choice is not None and choice.placement == {"n3": 4, "n2": 4, "n5": 2}
    # The greedy order inside S3: most cached bytes first (n3 holds 4 GB, n2 3 GB).
    assert list(choice.placement)[:2] == ["n3", "n2"]


def test_tdcs_suspends_over_the_copy_limit_and_releases_later() -> None:
    data = {"d": Dataset("d", 10 * GB, {"a": 10 * GB})}
    running = (JobState(job("r1", dataset="d"), {"a": 1}),)
    waiting = (JobState(job("w1", dataset="d")), JobState(job("w2")))
    state = cluster({"a": 3, "b": 4}, datasets=data, running=running, waiting=waiting)
    decisions = TdcsPolicy(max_jobs_per_copy=1).schedule(state)
    assert isinstance(decisions[0], Wait) and "suspended" in decisions[0].reason
    assert "w2" in starts(decisions)  # a suspended job does not block the queue
    released = cluster({"a": 4, "b": 4}, datasets=data, waiting=waiting[:1])
    assert starts(TdcsPolicy(max_jobs_per_copy=1).schedule(released)) == {"w1": {"a": 1}}


def test_tdcs_clone_makes_a_new_copy_outside_the_old_one() -> None:
    data = {"d": Dataset("d", 10 * GB, {"a": 10 * GB})}
    running = (JobState(job("r1", dataset="d"), {"a": 1}),)
    waiting = (JobState(job("w1", 2, dataset="d")), JobState(job("w2", dataset="d")))
    state = cluster({"a": 3, "b": 4, "c": 1}, datasets=data, running=running, waiting=waiting)
    decisions = TdcsPolicy(max_jobs_per_copy=1, overflow="clone").schedule(state)
    clones = [d for d in decisions if isinstance(d, Clone)]
    # w1 clones onto b (the node with most free GPUs outside the copy); the clone then serves
    # w1, its limit, so w2 clones again, onto c.
    assert clones == [Clone("d", frozenset({"b"})), Clone("d", frozenset({"c"}))]
    assert starts(decisions) == {"w1": {"b": 2}, "w2": {"c": 1}}


def test_tdcs_rejects_bad_settings() -> None:
    with pytest.raises(SchedulingError, match="overflow"):
        TdcsPolicy(overflow="drop")
    with pytest.raises(SchedulingError, match="max_jobs_per_copy"):
        TdcsPolicy(max_jobs_per_copy=0)


# --- P2 ------------------------------------------------------------------------------------


def test_p2_starts_every_request_with_one_gpu_then_expands() -> None:
    waiting = (JobState(job("a", max_gpus=8)), JobState(job("b", max_gpus=8)))
    decisions = ElasticPolicy().schedule(cluster({"n1": 4, "n2": 4}, waiting=waiting))
    placed = starts(decisions)
    assert set(placed) == {"a", "b"}
    assert sum(sum(p.values()) for p in placed.values()) == 8  # every idle GPU handed out


def test_p2_reduces_running_jobs_for_a_new_request() -> None:
    running = (JobState(job("a", max_gpus=8), {"n1": 4}), JobState(job("b", max_gpus=8), {"n2": 4}))
    waiting = (JobState(job("c", max_gpus=8)),)
    state = cluster({"n1": 0, "n2": 0}, running=running, waiting=waiting)
    decisions = ElasticPolicy().schedule(state)
    resized = [d for d in decisions if isinstance(d, Resize)]
    assert len(resized) == 1 and sum(resized[0].placement.values()) == 3
    assert sum(starts(decisions)["c"].values()) == 1


def test_p2_keeps_one_gpu_per_job_when_gpus_run_out() -> None:
    running = tuple(JobState(job(f"r{i}"), {"n1": 1}) for i in range(4))
    state = cluster({"n1": 0}, running=running, waiting=(JobState(job("late")),))
    decisions = ElasticPolicy().schedule(state)
    assert decisions == [Wait("late", "every GPU is held; waiting for one")]


def test_earliest_finish_gives_a_job_every_gpu_of_an_idle_cluster() -> None:
    assert EarliestFinishPolicy().place(job("j"), cluster({"a": 4, "b": 4})).placement == {
        "a": 4,
        "b": 4,
    }
    busy = cluster({"a": 4, "b": 3}, running=(JobState(job("r"), {"b": 1}),))
    assert EarliestFinishPolicy().place(job("j"), busy) is None


# --- P3 ------------------------------------------------------------------------------------


def test_quadratic_and_comm_fits_recover_their_parameters() -> None:
    a, b, c = fit_quadratic_throughput([(x, 100 + 3 * x - 0.01 * x * x) for x in (8, 32, 64, 128)])
    assert (a, b, c) == pytest.approx((100, 3, -0.01))
    samples = []
    for placement in ({"a": 2}, {"a": 4}, {"a": 1, "b": 1}, {"a": 2, "b": 2}):
        total = sum(placement.values())
        intra = sum(g * (g - 1) for g in placement.values()) / total
        inter = sum(g * (total - g) for g in placement.values()) / total
        measured = (total - 0.05 * (intra + 3.0 * inter)) * 500.0
        samples.append((placement, measured, 500.0))
    assert fit_comm_penalty(samples) == pytest.approx((0.05, 3.0))
    with pytest.raises(SchedulingError, match="3 distinct"):
        fit_quadratic_throughput([(1, 1.0), (2, 2.0)])


def test_ect_classes() -> None:
    urgent = job("u", arrival=100.0, qos=QosClass.URGENT)
    prior = job("p", arrival=100.0, qos=QosClass.PRIOR)
    normal = job("n", arrival=100.0)
    assert expected_completion(urgent) == 100.0
    assert expected_completion(prior) == pytest.approx(100.0 + single_gpu_seconds(prior))
    assert expected_completion(normal) == pytest.approx(100.0 + 2 * single_gpu_seconds(normal))


def test_p3_orders_by_slack_and_meets_ects_with_enough_gpus() -> None:
    # 3600 s on one GPU. At now = 3000 s, the Prior job (ECT 3600 s) needs at least 7 GPUs'
    # worth to finish in time; the Normal job (ECT 7200 s) is happy with fewer.
    prior = JobState(job("prior", qos=QosClass.PRIOR, max_gpus=8))
    normal = JobState(job("normal", qos=QosClass.NORMAL, max_gpus=8))
    state = cluster({"n1": 4, "n2": 4}, now=3000.0, waiting=(normal, prior))
    decisions = QosPolicy().schedule(state)
    placed = starts(decisions)
    assert list(placed) == ["prior", "normal"][: len(placed)]  # smallest slack first
    policy = QosPolicy()
    seconds = policy.predicted_seconds(prior.spec, placed["prior"], state, prior.remaining_samples)
    assert 3000.0 + seconds <= expected_completion(prior.spec)


def test_p3_urgent_goes_first() -> None:
    normal = JobState(job("normal", max_gpus=4))
    urgent = JobState(job("urgent", qos=QosClass.URGENT, max_gpus=4))
    decisions = QosPolicy().schedule(cluster({"n1": 4}, waiting=(normal, urgent)))
    assert next(iter(starts(decisions))) == "urgent"


def test_capacity_starts_only_queues_below_their_capacity() -> None:
    # 8 GPUs: Normal's capacity is 4 and a Normal job holds them; Prior's is 3 (no borrowing).
    running = (JobState(job("r", 4, qos=QosClass.NORMAL), {"n1": 4}),)
    waiting = (JobState(job("n", 1)), JobState(job("p", 1, qos=QosClass.PRIOR)))
    state = cluster({"n1": 0, "n2": 1}, running=running, waiting=waiting)
    assert starts(CapacityPolicy().schedule(state)) == {"p": {"n2": 1}}


# --- Tiresias LAS ---------------------------------------------------------------------------


def test_las_preempts_the_most_served_job_for_a_new_one() -> None:
    old = JobState(job("old", 4), {"n1": 4}, attained_gpu_s=40_000.0)
    new = JobState(job("new", 4, arrival=10.0))
    decisions = LasPolicy().schedule(cluster({"n1": 0}, running=(old,), waiting=(new,)))
    assert Resize("old", {}, "preempted by less-attained jobs") in decisions
    assert starts(decisions) == {"new": {"n1": 4}}
    policy = LasPolicy()
    assert policy.next_wakeup(cluster({"n1": 0}, running=(JobState(job("x", 2), {"n1": 2}),))) == (
        pytest.approx(3600.0 / 2)
    )


def test_profile_defaults_are_linear() -> None:
    assert LINEAR.throughput_coeffs == (1000.0, 0.0, 0.0)
