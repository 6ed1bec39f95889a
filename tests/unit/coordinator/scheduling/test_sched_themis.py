"""P5: finish-time fairness, the fluid T_id, the partial-allocation auction, Themis rounds over
apps of many jobs, and the paper's leased LAS — each step against small hand-computed cases.

The test profile (``sched_builders.LINEAR``) trains 1000 samples/s per GPU whatever the batch, so
a one-GPU job of 3.6e6 samples takes exactly one hour.

Envy-freeness: with indivisible GPUs and Themis' ρ valuations an envy-free allocation need not
exist (two identical apps, one GPU), so the auction is checked for exact envy-freeness when GPUs
split evenly among apps with linear valuations and for envy-freeness up to one GPU (EF1) on
random small linear cases.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_builders import cluster, job

from coordinator.scheduling.model import JobSpec, JobState, Resize, SchedulingError, Start, Wait
from coordinator.scheduling.themis import (
    FluidWork,
    LeasedLasPolicy,
    ThemisPolicy,
    app_independent_seconds,
    finish_time_fairness,
    fluid_finish_seconds,
    offered_count,
    pack_jobs,
    partial_allocation,
)

HOUR = 3600.0


def linear_bids(slopes: list[float], wants: list[int], capacity: int) -> dict[str, list[float]]:
    """App i values k extra GPUs at slope_i · min(k, want_i), and 0 GPUs at a tenth of one."""
    return {
        f"app{i}": [slope * (min(k, want) if k else 0.1) for k in range(capacity + 1)]
        for i, (slope, want) in enumerate(zip(slopes, wants, strict=True))
    }


def envies(bids: dict[str, list[float]], counts: dict[str, int], *, up_to_one: bool) -> bool:
    for app, values in bids.items():
        for other, count in counts.items():
            if other == app or count == 0:
                continue
            theirs = values[count - 1 if up_to_one else count]
            if theirs > values[counts[app]] + 1e-9:
                return True
    return False


def app_job(job_id: str, app: str, hours: float, gpus: int = 1, arrival: float = 0.0) -> JobSpec:
    """A job of ``app`` that takes ``hours`` on its ``gpus`` GPUs (no peers on one GPU)."""
    spec = job(job_id, gpus, samples=hours * HOUR * 1000.0 * gpus, arrival=arrival)
    return dataclasses.replace(spec, app=app)


def started(decisions: list) -> dict[str, int]:
    return {d.job_id: sum(d.placement.values()) for d in decisions if isinstance(d, Start)}


# --- ρ and T_id ---------------------------------------------------------------------------------


def test_rho_is_shared_over_independent_time() -> None:
    assert finish_time_fairness(300.0, 100.0) == 3.0


def test_fluid_finish_time_by_hand() -> None:
    jobs = [(3600.0, 2), (1800.0, 2), (1800.0, 4)]  # 18,000 GPU-seconds
    # 4 GPUs: no job is slowed (each fits), the GPU-seconds need 18000 / 4 = 4500 s.
    assert fluid_finish_seconds(jobs, 4) == 4500.0
    # 2 GPUs: the 4-GPU job is time-sliced to 3600 s; the GPU-seconds need 9000 s.
    assert fluid_finish_seconds(jobs, 2) == 9000.0
    # 16 GPUs: the longest job, 3600 s, bounds it.
    assert fluid_finish_seconds(jobs, 16) == 3600.0
    assert fluid_finish_seconds([], 4) == 0.0
    assert fluid_finish_seconds(jobs, 0) == math.inf


def test_independent_time_is_the_fluid_time_on_a_1_over_n_share() -> None:
    jobs = [(3600.0, 2), (1800.0, 2), (1800.0, 4)]
    # 50 GPUs, 10 apps: a share of 5 GPUs; max(3600, 18000 / 5) = 3600.
    assert app_independent_seconds(jobs, 50, 10.0) == 3600.0
    # 25 apps: 2 GPUs each, as on 2 GPUs above.
    assert app_independent_seconds(jobs, 50, 25.0) == 9000.0


def test_app_rho_by_hand() -> None:
    """An app of four one-hour one-GPU jobs, at t = 600 s on 4 GPUs shared by 2 apps: T_id on
    2 GPUs is 2 h; holding 2 GPUs it needs 2 h more, so ρ = (600 + 7200) / 7200; holding none
    it waits a 20-min lease, then runs on its 2-GPU share: (600 + 1200 + 7200) / 7200."""
    policy = ThemisPolicy(lease_s=1200.0)
    jobs = tuple(JobState(app_job(f"hp/{i}", "hp", 1.0)) for i in range(4))
    state = cluster({"n1": 4}, now=600.0, waiting=jobs)
    policy.schedule(state)  # the arbiter records the app's jobs
    remaining = FluidWork.of([(HOUR, 1)] * 4)
    assert policy.app_rho("hp", remaining, 2, state, 2) == pytest.approx(7800 / 7200)
    assert policy.app_rho("hp", remaining, 0, state, 2) == pytest.approx(9000 / 7200)


def test_offered_apps_are_the_1_minus_f_fraction() -> None:
    assert offered_count(10, 0.8) == 2
    assert offered_count(5, 0.8) == 1  # (1 - 0.8)·5 is 0.999... in floating point
    assert offered_count(3, 0.8) == 1
    assert offered_count(7, 0.0) == 7
    assert offered_count(1, 0.95) == 1


def test_agents_pack_whole_jobs_in_their_order() -> None:
    # 7 GPUs: the 4-GPU job, then the 2-GPU job; the second 4-GPU job does not fit; the 1 does.
    assert pack_jobs([4, 2, 4, 1], 7) == [0, 1, 3]
    assert pack_jobs([4, 4], 3) == []


# --- the partial-allocation auction ---------------------------------------------------------------


def test_partial_allocation_by_hand() -> None:
    """a: 1, 3, 4 for 0, 1, 2 GPUs; b: 1, 2, 2.5. Products: (2,0) 4, (1,1) 6, (0,2) 2.5: one
    each. Without a, b would take both (2.5), so c_a = 2 / 2.5; without b, a would take both
    (4): c_b = 3 / 4. Both keep their GPU (0.8 and 0.75 round to 1)."""
    result = partial_allocation({"a": [1.0, 3.0, 4.0], "b": [1.0, 2.0, 2.5]}, 2)
    assert result.won == {"a": 1, "b": 1}
    assert result.fractions == {"a": pytest.approx(0.8), "b": pytest.approx(0.75)}
    assert result.kept == {"a": 1, "b": 1}


def test_partial_allocation_withholds_the_hidden_payment() -> None:
    """a: 1, 1.5, 4; b: 1, 3.9, 4. (1,1) gives 5.85, more than 4 for either app alone. b's
    GPU costs a 1.5 / 4 of its best, so c_b = 0.375 and b keeps round(0.375) = 0 GPUs."""
    result = partial_allocation({"a": [1.0, 1.5, 4.0], "b": [1.0, 3.9, 4.0]}, 2)
    assert result.won == {"a": 1, "b": 1}
    assert result.fractions["a"] == pytest.approx(3.9 / 4.0)
    assert result.fractions["b"] == pytest.approx(1.5 / 4.0)
    assert result.kept == {"a": 1, "b": 0}


def test_even_split_is_envy_free_and_pays_equal_fractions() -> None:
    bids = linear_bids([1.0, 3.0, 5.0], [8, 8, 8], 6)
    result = partial_allocation(bids, 6)
    assert result.won == {"app0": 2, "app1": 2, "app2": 2}
    assert not envies(bids, result.won, up_to_one=False)
    # Linear valuations: each app's hidden payment is the same, ((n-1)/n)^(n-1) = 4/9 here.
    for fraction in result.fractions.values():
        assert fraction == pytest.approx((2 * 2) / (3 * 3))
    assert not envies(bids, result.kept, up_to_one=False)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.5, 5.0), st.integers(1, 6)), min_size=2, max_size=4),
    st.integers(1, 8),
)
def test_auction_is_envy_free_up_to_one_gpu(apps: list[tuple[float, int]], capacity: int) -> None:
    bids = linear_bids([s for s, _ in apps], [w for _, w in apps], capacity)
    result = partial_allocation(bids, capacity)
    assert sum(result.won.values()) <= capacity
    assert not envies(bids, result.won, up_to_one=True)
    for app, fraction in result.fractions.items():
        assert 0.0 < fraction <= 1.0
        assert result.kept[app] <= result.won[app]


def test_bids_must_be_positive() -> None:
    with pytest.raises(SchedulingError, match="positive"):
        partial_allocation({"a": [0.0, 1.0]}, 1)


# --- Themis rounds over apps ----------------------------------------------------------------------


def test_a_search_app_bids_as_one_app_and_wins_all_it_can_use() -> None:
    """4 GPUs; "hp" = four one-hour 1-GPU trials, "solo" = one four-hour 1-GPU job, both new.
    T_id on a 2-GPU share: hp 2 h, solo 4 h. Waiting a lease: ρ_hp = (1200 + 7200) / 7200 =
    1.17, ρ_solo = (1200 + 14400) / 14400 = 1.08, so with f = 0.8 hp alone is offered the pool.
    Its bid (1/ρ for 0..4 GPUs) peaks at 4 GPUs (ρ = 3600 / 7200): it wins them all."""
    policy = ThemisPolicy(lease_s=1200.0, fairness_knob=0.8)
    jobs = (
        *(JobState(app_job(f"hp/{i}", "hp", 1.0)) for i in range(4)),
        JobState(app_job("solo/0", "solo", 4.0)),
    )
    decisions = policy.schedule(cluster({"n1": 4}, waiting=jobs))
    assert started(decisions) == {f"hp/{i}": 1 for i in range(4)}
    assert [d.job_id for d in decisions if isinstance(d, Wait)] == ["solo/0"]


def test_the_app_furthest_behind_wins_where_las_serves_fresh_jobs() -> None:
    """At t = 3 h "solo" (arrived at 0, ran 20 min, then lost its lease) has 3h40m left; the
    search "hp" (four 1-h trials) just arrived. ρ if it waits a lease: solo (10800 + 1200 +
    13200) / 14400 = 1.75, hp (1200 + 7200) / 7200 = 1.17: solo is offered, wins its one GPU,
    and the three leftover GPUs go to hp's trials. The paper's LAS gives all four GPUs to
    hp's trials (no attained service) and leaves solo waiting."""
    solo = JobState(app_job("solo/0", "solo", 4.0), samples_done=1.2e6, attained_gpu_s=1200.0)
    trials = tuple(JobState(app_job(f"hp/{i}", "hp", 1.0, arrival=3 * HOUR)) for i in range(4))
    state = cluster({"n1": 4}, now=3 * HOUR, waiting=(solo, *trials))
    decisions = ThemisPolicy(lease_s=1200.0, fairness_knob=0.8).schedule(state)
    assert started(decisions) == {"solo/0": 1, "hp/0": 1, "hp/1": 1, "hp/2": 1}
    las = LeasedLasPolicy(lease_s=1200.0)
    assert started(las.schedule(state)) == {f"hp/{i}": 1 for i in range(4)}


def test_bids_see_the_placement_the_pool_allows() -> None:
    """One app, one 1-h 4-GPU job (1.44e7 samples), alone on two 4-GPU nodes with 2 GPUs free
    on each. Packed on one node it loses γ·3 = 0.06 GPUs: 3940 samples/s, 3654.8 s = T_id (8
    GPUs, N = 1). The pool can only give it 2 + 2 GPUs, losing γ·(1 + 4·2) = 0.18 GPUs: 3820
    samples/s, so its bid for 4 GPUs is T_id / 3769.6 s; by GPU count alone it would be 1.
    Fewer than 4 GPUs run nothing: it waits a lease (1200 s), then runs packed."""
    state = cluster({"n1": 2, "n2": 2}, waiting=(JobState(app_job("a/0", "a", 1.0, gpus=4)),))
    packed, spread = 1.44e7 / 3940.0, 1.44e7 / 3820.0
    waiting = packed / (1200.0 + packed)
    aware = ThemisPolicy(lease_s=1200.0)
    aware.schedule(state)
    assert aware.last_bids["a"] == pytest.approx([waiting] * 4 + [packed / spread])
    by_count = ThemisPolicy(lease_s=1200.0, placement_aware=False)
    by_count.schedule(state)
    assert by_count.last_bids["a"] == pytest.approx([waiting] * 4 + [1.0])


def test_jobs_are_gang_scheduled_on_their_demand() -> None:
    policy = ThemisPolicy(fairness_knob=0.0)
    jobs = tuple(JobState(app_job(f"a/{i}", "a", 1.0, gpus=4)) for i in range(3))
    decisions = policy.schedule(cluster({"n1": 4, "n2": 4, "n3": 2}, waiting=jobs))
    assert sorted(started(decisions).values()) == [4, 4]  # never a 4-GPU job on 2


def test_leases_expire_and_an_app_that_wins_again_keeps_its_gpus() -> None:
    policy = ThemisPolicy(lease_s=600.0)
    waiting = (JobState(app_job("a/0", "a", 1.0, gpus=4)), JobState(app_job("b/0", "b", 1.0, 2)))
    decisions = policy.schedule(cluster({"n1": 4, "n2": 2}, waiting=waiting))
    assert sum(started(decisions).values()) == 6  # work conserving: leftovers go to the others
    running = tuple(
        JobState(next(j.spec for j in waiting if j.job_id == d.job_id), d.placement)
        for d in decisions
        if isinstance(d, Start)
    )
    assert policy.next_wakeup(cluster({"n1": 0, "n2": 0}, running=running)) == 600.0
    # At expiry with nothing new, every app wins its GPUs back and keeps them: no decision.
    assert policy.schedule(cluster({"n1": 0, "n2": 0}, now=600.0, running=running)) == []


def test_fairness_knob_and_lease_are_checked() -> None:
    with pytest.raises(SchedulingError, match="fairness knob"):
        ThemisPolicy(fairness_knob=1.0)
    with pytest.raises(SchedulingError, match="lease_s"):
        ThemisPolicy(lease_s=0.0)
    assert math.isclose(ThemisPolicy().fairness_knob, 0.8)


# --- the paper's LAS: leases, least attained GPU time ---------------------------------------------


def test_leased_las_keeps_a_lease_then_gives_the_gpus_to_the_least_served_job() -> None:
    policy = LeasedLasPolicy(lease_s=600.0)
    old = JobState(job("old", 4), {"n1": 4}, attained_gpu_s=8000.0)
    new = JobState(job("new", 4, arrival=100.0))
    # The lease has not expired: the old job keeps its GPUs, the new one waits.
    first = policy.schedule(cluster({"n1": 0}, now=100.0, running=(old,)))
    assert first == []
    assert policy.next_wakeup(cluster({"n1": 0}, now=100.0, running=(old,))) == 700.0
    waiting = policy.schedule(cluster({"n1": 0}, now=200.0, running=(old,), waiting=(new,)))
    assert waiting == [Wait("new", "not granted GPUs this round")]
    # On expiry the GPUs go to the job with less attained service.
    expiry = policy.schedule(cluster({"n1": 0}, now=700.0, running=(old,), waiting=(new,)))
    assert [type(d) for d in expiry] == [Resize, Start]
    assert expiry[1] == Start("new", {"n1": 4}, "least attained GPU time")


def test_leased_las_is_work_conserving_and_gang_scheduled() -> None:
    policy = LeasedLasPolicy()
    waiting = (
        JobState(job("big", 8), attained_gpu_s=0.0),
        JobState(job("two", 2), attained_gpu_s=50.0),
        JobState(job("one", 1), attained_gpu_s=100.0),
    )
    # 6 GPUs: the 8-GPU job cannot run; the next jobs by attained service fill what they can.
    decisions = policy.schedule(cluster({"n1": 4, "n2": 2}, waiting=waiting))
    assert started(decisions) == {"two": 2, "one": 1}


def test_holding_for_the_worst_app_keeps_narrow_jobs_off_its_gpus() -> None:
    """8 GPUs; "busy" won 6 of them 10 min ago (its lease runs 10 min more). At t = 2 h
    "wide" (one 1-h 8-GPU job, waiting since t = 0) is furthest behind: ρ = (7200 + 1200 +
    11337) / 11337 = 1.74 on a share of 8/3 GPUs, against (1200 + 3600) / 3600 = 1.33 for
    "narrow", a 1-GPU job that just arrived. The paper's round gives the 2 free GPUs to the
    narrow job (leftovers are work conserving); holding them for the worst app leaves them idle
    until its job fits."""
    busy = app_job("busy/0", "busy", 9.0, gpus=6)
    wide = JobState(app_job("wide/0", "wide", 1.0, gpus=8))
    narrow = JobState(app_job("narrow/0", "narrow", 1.0, arrival=2 * HOUR))
    outcomes = []
    for policy in (ThemisPolicy(), ThemisPolicy(hold_for_worst=True)):
        first = policy.schedule(
            cluster({"n1": 4, "n2": 4}, now=2 * HOUR - 600.0, waiting=(JobState(busy),))
        )
        (placement,) = [d.placement for d in first if isinstance(d, Start)]
        running = (JobState(busy, placement),)
        free = {node: 4 - placement.get(node, 0) for node in ("n1", "n2")}
        state = cluster(free, now=2 * HOUR, running=running, waiting=(wide, narrow))
        outcomes.append(started(policy.schedule(state)))
    assert outcomes == [{"narrow/0": 1}, {}]


def test_leased_las_can_place_blind_to_placement() -> None:
    waiting = tuple(JobState(job(f"j{i}", 3)) for i in range(2))
    state = cluster({"n1": 4, "n2": 4}, waiting=waiting)
    blind = LeasedLasPolicy(random_seed=0).schedule(state)
    assert blind == LeasedLasPolicy(random_seed=0).schedule(state)  # seeded
    assert started(blind) == {"j0": 3, "j1": 3}  # still each job's whole demand
