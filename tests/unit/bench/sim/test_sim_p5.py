"""P5's experiment: the workload (apps of many jobs, successive halving, the load), the per-app
metric ρ = T_sh / T_id with N = the apps contending, and a small run of both policies."""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.engine import Simulator
from bench.sim.experiments import p5
from bench.sim.metrics import JobRecord, SimResult
from bench.sim.traces import job_lasting
from bench.sim.truth import profiles

PROFILES = profiles(0)
HOUR = 3600.0


def test_successive_halving_by_hand() -> None:
    """10 trials, η = 3: stages of 10, 3 and 1 trials (R = 2) run to T/9, T/3 and T."""
    full = 900.0
    assert p5.trial_seconds(10, full, 3) == [900.0, 300.0, 300.0] + [100.0] * 7
    assert p5.trial_seconds(1, full, 3) == [900.0]
    assert p5.trial_seconds(4, full, 0) == [900.0] * 4  # no early stopping
    # η = 2 on 8 trials: 8, 4, 2, 1 trials to T/8, T/4, T/2, T.
    assert p5.trial_seconds(8, 800.0, 2) == [800.0, 400.0, 200.0, 200.0] + [100.0] * 4
    with pytest.raises(ValueError):
        p5.trial_seconds(0, full, 3)


def test_the_cluster_has_the_papers_50_gpus() -> None:
    for per_node in (2, 4, 8):
        nodes = p5.cluster_of(p5.Setup(gpus_per_node=per_node)).nodes
        assert sum(node.gpus for node in nodes) == 50
        assert max(node.gpus for node in nodes) == per_node


def test_workload_has_the_papers_app_shape() -> None:
    setup = p5.Setup()
    apps: dict[str, list] = {}
    for seed in range(4):
        for spec in p5.workload(seed, setup, PROFILES).jobs:
            apps.setdefault(f"{seed}:{spec.app}", []).append(spec)
    sizes = [len(jobs) for jobs in apps.values()]
    assert max(sizes) <= p5.MAX_JOBS
    assert 0.0 < sum(size == 1 for size in sizes) / len(sizes) < 0.25  # ~10 % single-job
    for jobs in apps.values():  # one search: one arrival, one model, one GPU count
        assert len({(j.arrival, j.profile.name, j.gpus) for j in jobs}) == 1


def test_load_only_rescales_the_arrivals() -> None:
    light = p5.workload(3, p5.Setup(load=0.5), PROFILES).jobs
    heavy = p5.workload(3, p5.Setup(load=1.0), PROFILES).jobs
    assert [j.samples for j in light] == [j.samples for j in heavy]
    assert [j.arrival / 2 for j in light] == pytest.approx([j.arrival for j in heavy])


def test_contending_apps_by_hand() -> None:
    # a and b overlap for 5 of their 10 s: N = (10 + 5) / 10; c runs alone.
    intervals = {"a": (0.0, 10.0), "b": (5.0, 15.0), "c": (20.0, 30.0)}
    assert p5.contending_apps(intervals) == {"a": 1.5, "b": 1.5, "c": 1.0}


def _record(spec, start: float, finish: float) -> JobRecord:
    return JobRecord(spec, start, finish, 1.0, 0.0, 0.0, 0.0, 0)


def test_app_rho_by_hand() -> None:
    """On 4 GPUs: app "s" (two 1-h 1-GPU trials, arrive at 0, finish at 1 h and 3 h) and app
    "t" (one 2-h 1-GPU job, 1 h to 3 h). N_s = (3 + 2) / 3 h, a share of 4 / (5/3) = 2.4 GPUs:
    T_id(s) = max(1 h, 2 GPU-h / 2.4) = 1 h, ρ_s = 3. N_t = 2: T_id(t) = 2 h, ρ_t = 1."""

    def spec(job_id: str, app: str, hours: float, arrival: float):
        made = job_lasting(
            job_id,
            arrival,
            hours * HOUR,
            1,
            PROFILES["resnet50"],
            per_node=4,
            samples_per_epoch=50_000,
        )
        return dataclasses.replace(made, app=app)

    jobs = (
        _record(spec("s/0", "s", 1.0, 0.0), 0.0, 1 * HOUR),
        _record(spec("s/1", "s", 1.0, 0.0), 2 * HOUR, 3 * HOUR),
        _record(spec("t/0", "t", 2.0, 1 * HOUR), 1 * HOUR, 3 * HOUR),
    )
    result = SimResult("x", 4, jobs, 0.0, 0.0, 0)
    apps = {app.app: app for app in p5.app_records(result, per_node=4)}
    assert apps["s"].contending == pytest.approx(5 / 3)
    assert apps["s"].independent_s == pytest.approx(HOUR)
    assert apps["s"].rho == pytest.approx(3.0)
    assert apps["t"].contending == pytest.approx(2.0)
    assert apps["t"].rho == pytest.approx(1.0)


def test_a_small_run_finishes_every_app_under_both_policies() -> None:
    setup = p5.Setup(apps=6)
    rows = p5.simulate(setup, (0,), ("themis", "las-leases"))
    for name in ("themis", "las-leases"):
        (summary,) = rows[name]
        assert summary["max_rho"] >= summary["mean_rho"] > 0
        assert 0.0 < summary["gpu_utilisation"] <= 1.0
    # Both policies run the same work: GPU-hours differ only by placement and restarts.
    themis, las = rows["themis"][0]["gpu_hours"], rows["las-leases"][0]["gpu_hours"]
    assert themis == pytest.approx(las, rel=0.1)


def test_each_job_runs_on_exactly_its_gpus() -> None:
    setup = p5.Setup(apps=5)
    trace = p5.workload(1, setup, PROFILES)
    for policy in (p5.policy_for("themis", setup), p5.policy_for("las-leases", setup)):
        simulator = Simulator(p5.cluster_of(setup), trace, policy)
        apply = simulator._apply

        def checked(decisions, apply=apply, simulator=simulator):  # type: ignore[no-untyped-def]
            for decision in decisions:
                placement = getattr(decision, "placement", None)
                if placement:
                    assert sum(placement.values()) == simulator.jobs[decision.job_id].spec.gpus
            apply(decisions)

        simulator._apply = checked  # type: ignore[method-assign]
        simulator.run()
