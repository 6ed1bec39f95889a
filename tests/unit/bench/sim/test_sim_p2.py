"""P2's experiment: the paper's set-up (classes, mixes, baselines), the ground truth, the bound
on P2's makespan against EF, and a timeline worked by hand."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest

from bench.sim.cluster import ClusterConfig, NodeSpec, Trace
from bench.sim.engine import Simulator
from bench.sim.experiments import p2
from bench.sim.report import figure, verdict
from coordinator.scheduling import make_policy
from coordinator.scheduling.model import JobSpec

MINUTE = 60.0


def one_gpu_minutes(spec: JobSpec) -> float:
    return spec.epochs * p2.EPOCH_S[spec.profile.name] / MINUTE


# --- the workload -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_class", "epoch_s", "expected"),
    [
        # 1.5-min epochs: micro 6–10 min = 4..6 epochs (6, 7.5, 9 min); small (10, 60] = 7..40;
        # medium (60, 120] = 41..80; large (120, 240] = 81..160.
        ("micro", 90.0, (4, 6)),
        ("small", 90.0, (7, 40)),
        ("medium", 90.0, (41, 80)),
        ("large", 90.0, (81, 160)),
        # 20-min epochs: never micro; small 1..3 (20–60 min); medium 4..6; large 7..12.
        ("micro", 1200.0, None),
        ("small", 1200.0, (1, 3)),
        ("medium", 1200.0, (4, 6)),
        ("large", 1200.0, (7, 12)),
        # 10-min epochs: one epoch is micro (10 min is the class's top), 2..6 small.
        ("micro", 600.0, (1, 1)),
        ("small", 600.0, (2, 6)),
    ],
)
def test_class_epochs_by_hand(
    job_class: str, epoch_s: float, expected: tuple[int, int] | None
) -> None:
    assert p2.class_epochs(job_class, epoch_s, large_max_min=240.0) == expected


def test_every_job_lands_in_its_class_and_asks_one_gpu() -> None:
    for workload, seed in itertools.product(p2.WORKLOADS, range(5)):
        trace = p2.job_set(seed, workload, 15.0)
        assert len(trace.jobs) == p2.JOBS_PER_SET
        assert trace.jobs[0].arrival == 0.0
        assert [j.arrival for j in trace.jobs] == sorted(j.arrival for j in trace.jobs)
        for spec in trace.jobs:
            minutes = one_gpu_minutes(spec)
            low, high = p2.CLASS_BOUNDS_MIN[p2.job_class(spec.job_id)]
            high = p2.MAIN.large_max_min if high is None else high
            assert (low <= minutes if low == 6.0 else low < minutes) and minutes <= high + 1e-9
            assert spec.epochs == int(spec.epochs) >= 1
            assert spec.gpus == 1 and spec.gpu_cap == 12


def test_the_mixes_follow_the_workloads() -> None:
    # Only workload 1 has micro jobs (section 4.1); over 50 sets each class's share is near
    # the mix (1000 jobs: a share's standard error is at most 1.6 %).
    for workload, mix in p2.WORKLOADS.items():
        counts = Counter(
            p2.job_class(spec.job_id)
            for seed in range(50)
            for spec in p2.job_set(seed, workload, 15.0).jobs
        )
        assert ("micro" in counts) == (workload == "workload1")
        for job_class, share in mix.items():
            assert counts[job_class] / 1000 == pytest.approx(share, abs=0.06)


def test_gaps_scale_but_the_jobs_stay_the_same() -> None:
    ten = p2.job_set(3, "workload2", 10.0)
    twenty = p2.job_set(3, "workload2", 20.0)
    for a, b in zip(ten.jobs, twenty.jobs, strict=True):
        assert (a.job_id, a.profile, a.samples) == (b.job_id, b.profile, b.samples)
        assert b.arrival == pytest.approx(2 * a.arrival)
    literal = p2.job_set(3, "workload2", 15.0, replace(p2.MAIN, gaps="poisson"))
    assert all(job.arrival % MINUTE == 0 for job in literal.jobs)
    gaps = [
        b.arrival - a.arrival
        for seed in range(40)
        for a, b in itertools.pairwise(
            p2.job_set(seed, "workload3", 15.0, replace(p2.MAIN, gaps="poisson")).jobs
        )
    ]
    assert sum(gaps) / len(gaps) == pytest.approx(15 * MINUTE, rel=0.05)


# --- the ground truth -------------------------------------------------------------------------


def test_true_speed_by_hand() -> None:
    # γ = 0.05, λ = 3, 2080 Ti = 1.3x P100. On all 12 GPUs each GPU has 3 same-server and 8
    # other-server peers: Comm = 0.05 × (3 + 3 × 8) = 1.35, and the P100s set the pace:
    # S = 12 − 1.35 = 10.65. Two GPUs on the 2080 Ti server: (2 − 0.05) × 1.3 = 2.535.
    assert p2.whole_cluster_speed(p2.MAIN) == pytest.approx(10.65)
    assert p2.speed_on(p2.MAIN, {p2.FAST_SERVER: 2}) == pytest.approx(2.535)
    assert p2.speed_on(p2.MAIN, {"node01": 1}) == pytest.approx(1.0)
    # C = 4 × 1.3 + 8 = 13.2, so P2 can cut EF's makespan by at most 1 − 10.65/13.2.
    assert p2.total_speed(p2.MAIN) == pytest.approx(13.2)
    assert p2.makespan_floor_vs_ef(p2.MAIN) == pytest.approx(10.65 / 13.2 - 1)
    # Two P100 servers: 8 − 0.05 × (3 + 3 × 4) = 7.25; one: 4 − 0.05 × 3 = 3.85.
    assert p2.server_scaling(p2.MAIN) == pytest.approx(7.25 / 7.7)


def test_gamma_needed_gives_the_papers_ratio() -> None:
    gamma = p2.gamma_needed(0.65, p2.MAIN)
    # 12 − 27γ = 0.65 × 13.2  ->  γ = (12 − 8.58) / 27.
    assert gamma == pytest.approx((12 - 0.65 * 13.2) / 27, abs=1e-9)


# --- the policies on a timeline worked by hand ------------------------------------------------


def two_job_run(policy: str) -> dict[str, tuple[float, float]]:
    """One P100 server of 2 GPUs, linear scaling; A (60 s epochs, 4 epochs) at 0 s, B (60 s
    epochs, 1 epoch) at 60 s. Returns job -> (first start, finish)."""
    setting = replace(p2.MAIN, gamma=0.0, fast_speed=1.0)
    cluster = ClusterConfig((NodeSpec("node01", 2),), cache_mode="none", restart_s=10.0)
    profile = p2.known_profile("p2-model-a")
    spe = p2.SAMPLES_PER_EPOCH
    jobs = (
        JobSpec("A", 0.0, 1, profile, 4.0 * spe, spe, 64, True, max_gpus=2),
        JobSpec("B", 60.0, 1, profile, 1.0 * spe, spe, 64, True, max_gpus=2),
    )
    result = Simulator(
        cluster, Trace(jobs), make_policy(policy), truth=p2.true_models(setting)
    ).run()
    return {r.spec.job_id: (r.first_start, r.finish) for r in result.jobs}


def test_p2_timeline_by_hand() -> None:
    # t=0: A starts on 1 GPU and expansion adds the idle one (30 s per epoch).
    # t=60: A has 2 epochs left; B arrives, no GPU idle: K' = min(1, 2 − 1) = 1, A shrinks to
    #       1 GPU (stopped 10 s) and B starts on the other.
    # t=70..120: A on 1 GPU does 50/60 epoch; B finishes at 120.
    # t=120: A expands to 2 GPUs (stopped 10 s), then 1 1/6 epochs at 30 s = 35 s: ends 165.
    times = two_job_run("p2-elastic")
    assert times["B"] == pytest.approx((60.0, 120.0))
    assert times["A"] == pytest.approx((0.0, 165.0))


def test_fcfs_and_ef_timelines_by_hand() -> None:
    # FCFS: one GPU each, never changed: A 0..240, B 60..120.
    fcfs = two_job_run("fifo")
    assert fcfs["A"] == pytest.approx((0.0, 240.0))
    assert fcfs["B"] == pytest.approx((60.0, 120.0))
    # EF: all GPUs to one job at a time: A 0..120 on 2 GPUs, B waits, then 120..150.
    ef = two_job_run("p2-earliest-finish")
    assert ef["A"] == pytest.approx((0.0, 120.0))
    assert ef["B"] == pytest.approx((120.0, 150.0))


def test_the_makespan_bound_holds_on_simulated_sets() -> None:
    # P2's makespan >= (S / C) x EF's on every set, whatever the scaling.
    for setting in (p2.MAIN, replace(p2.MAIN, gamma=0.3)):
        ratio = p2.whole_cluster_speed(setting) / p2.total_speed(setting)
        for seed in range(3):
            trace = p2.job_set(seed, "workload4", 10.0, setting)
            ef = p2.run_set(trace, "p2-earliest-finish", setting)
            elastic = p2.run_set(trace, "p2-elastic", setting)
            assert elastic.makespan_s >= ratio * ef.makespan_s - 1e-6


def test_fcfs_runs_every_job_on_one_gpu_and_ef_one_job_at_a_time() -> None:
    trace = p2.job_set(1, "workload3", 15.0)
    setting = p2.MAIN
    truth = p2.true_models(setting)
    fcfs = Simulator(p2.cluster(setting), trace, make_policy("fifo"), truth=truth).run()
    for record in fcfs.jobs:
        assert record.restarts == 0
        one_gpu_s = one_gpu_minutes(record.spec) * MINUTE
        ran = record.finish - record.first_start
        assert ran == pytest.approx(one_gpu_s) or ran == pytest.approx(one_gpu_s / 1.3)
    ef = Simulator(p2.cluster(setting), trace, make_policy("p2-earliest-finish"), truth=truth).run()
    spans = sorted((r.first_start, r.finish) for r in ef.jobs)
    assert all(end <= start + 1e-6 for (_, end), (start, _) in itertools.pairwise(spans))
    order = [r.spec.job_id for r in sorted(ef.jobs, key=lambda r: r.first_start)]
    assert order == [spec.job_id for spec in trace.jobs]  # arrival order


# --- the report -------------------------------------------------------------------------------


def test_report_states_what_it_computed() -> None:
    report = p2.run(seeds=(0,))
    data = report.data
    assert data["paper"] == {
        "jct_vs_fcfs": -0.40,
        "jct_vs_ef": -0.58,
        "makespan_vs_fcfs": -0.30,
        "makespan_vs_ef": -0.35,
    }
    # The headline is recomputed from the per-workload means in the JSON.
    cells = data["section_4_2"]
    for key, metric, baseline in (
        ("jct_vs_fcfs", "jct_s", "fifo"),
        ("makespan_vs_ef", "makespan_s", "p2-earliest-finish"),
    ):
        changes = [
            cell["means"]["p2-elastic"][metric] / cell["means"][baseline][metric] - 1
            for cell in cells
        ]
        assert data["ours"][key] == pytest.approx(sum(changes) / len(changes))
        assert data["verdicts"][key] == verdict(data["ours"][key], figure(data["paper"][key], 0.01))
    # Every sweep row keeps P2's makespan against EF above its bound.
    for row in data["sweep"]:
        assert row["changes"]["makespan_vs_ef"] >= row["makespan_floor_vs_ef"] - 1e-9
    markdown = report.markdown()
    assert "Which of the paper's claims cannot hold" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| makespan vs EF |"))
    assert data["verdicts"]["makespan_vs_ef"] in row
