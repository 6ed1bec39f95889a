"""P3's experiment: the K80 ground truth, the task queue, the metrics and the bounds, checked
against hand-worked numbers and the published measurements they come from."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from bench.sim.cluster import Trace
from bench.sim.experiments import p3
from bench.sim.metrics import JobRecord, SimResult
from bench.sim.truth import (
    INFERENCE_SUFFIX,
    K80_MEASURED,
    SyncTrainingModel,
    k80_catalogue,
    k80_profiles,
)
from coordinator.scheduling.model import JobSpec, ModelProfile, QosClass

LINEAR = ModelProfile("linear", (1000.0, 0.0, 0.0))


def spec(batch: int, *, per_gpu: bool = False, name: str = "m") -> JobSpec:
    return JobSpec("t", 0.0, 1, ModelProfile(name, (1.0, 0.0, 0.0)), 1.0, 1, batch, per_gpu)


# --- the ground truth -------------------------------------------------------------------------


def test_a_step_is_compute_plus_a_two_level_all_reduce() -> None:
    # 50 ms per step + 10 ms per sample; 100 MB of gradients, 2 GB/s inside, 1 GB/s between.
    model = SyncTrainingModel("m", 0.05, 0.01, 1e8, 2e9, 1e9)
    # ⟨2,2⟩ at global batch 64: local 16; compute 0.05 + 0.16 = 0.21 s;
    # all-reduce 2·(1/2)·1e8/2e9 + 2·(1/2)·1e8/1e9 = 0.05 + 0.1 = 0.15 s; 4·16 / 0.36 samples/s.
    assert model.sync_seconds({"a": 2, "b": 2}) == pytest.approx(0.15)
    assert model.rate(spec(64), {"a": 2, "b": 2}) == pytest.approx(4 * 16 / 0.36)
    # One core: no exchange; 64 / (0.05 + 0.64).
    assert model.rate(spec(64), {"a": 1}) == pytest.approx(64 / 0.69)
    # An uneven placement: the busiest node's 3 cores inside, 2 nodes across.
    assert model.sync_seconds({"a": 3, "b": 1}) == pytest.approx(
        2 * 2 / 3 * 1e8 / 2e9 + 2 * 1 / 2 * 1e8 / 1e9
    )
    inference = SyncTrainingModel("m", 0.05, 0.01, 0.0, 2e9, 1e9)
    assert inference.rate(spec(64), {"a": 2, "b": 2}) == pytest.approx(4 * 16 / 0.21)


def test_the_catalogue_reproduces_the_published_k80_measurements() -> None:
    truth = k80_catalogue()
    for name, (one_core, (batch, four_cores)) in K80_MEASURED.items():
        model = truth[name]
        for measured_batch, rate in one_core.items():
            assert model.per_gpu(measured_batch) == pytest.approx(rate)
        four = model.rate(spec(batch, per_gpu=True, name=name), {"n": 4})
        assert four == pytest.approx(four_cores)
    # Inference: the forward pass, a third of a training step, and no exchange.
    resnet, forward = truth["resnet50"], truth["resnet50" + INFERENCE_SUFFIX]
    assert forward.per_gpu(64) == pytest.approx(3 * resnet.per_gpu(64))
    assert forward.sync_seconds({"a": 4, "b": 4}) == 0.0
    assert set(truth) == {n + s for n in p3.P3_MODEL_NAMES for s in ("", INFERENCE_SUFFIX)}


def test_the_truth_is_not_p3s_predictor() -> None:
    """P3's Comm(s) is a number of GPUs lost per placement whatever the batch; in the truth the
    loss shrinks as the local batch grows (the exchange is fixed, the compute is not)."""
    model = k80_catalogue()["resnet50"]
    shape = {"a": 4, "b": 4}

    def lost(batch: int) -> float:
        return 8 - model.rate(spec(batch, name="resnet50"), shape) / model.per_gpu(batch / 8)

    assert lost(32) > 1.5 * lost(256) > 0


def test_profiles_are_deterministic_and_named_after_their_truth() -> None:
    truth = k80_catalogue()
    one, two = k80_profiles(3, truth), k80_profiles(3, truth)
    assert one == two
    assert set(one) == set(truth)
    assert all(profile.comm_gamma >= 0 for profile in one.values())


# --- the task queue -----------------------------------------------------------------------------


def test_the_queue_has_the_papers_mix() -> None:
    profiles = k80_profiles(0, k80_catalogue())
    trace = p3.p3_tasks(1, profiles, per_hour=20.0)
    total = len(trace.jobs)
    assert total == pytest.approx(480, rel=0.15)
    counts = Counter(job.qos for job in trace.jobs)
    assert counts[QosClass.URGENT] / total == pytest.approx(0.05, abs=0.03)
    assert counts[QosClass.PRIOR] / total == pytest.approx(0.35, abs=0.06)
    inference = sum(job.profile.name.endswith(INFERENCE_SUFFIX) for job in trace.jobs)
    assert inference / total == pytest.approx(0.5, abs=0.08)
    low, high = p3.ITERATIONS
    for job in trace.jobs:
        assert job.batch_size in p3.BATCHES and not job.batch_per_gpu
        assert low <= job.samples / job.batch_size <= high
        assert job.max_gpus == 16 and job.gpus in p3.DEFAULT.requests
        assert 0.0 <= job.arrival < 24 * 3600
    # What users ask comes from its own stream: the rest of the queue does not move.
    other = p3.p3_tasks(1, profiles, per_hour=20.0, requests=(1,))
    assert [replace(j, gpus=1) for j in trace.jobs] == list(other.jobs)
    doubled = p3.p3_tasks(1, profiles, per_hour=20.0, size_scale=2.0)
    assert [j.arrival for j in doubled.jobs] == [j.arrival for j in trace.jobs]


# --- metrics and bounds -------------------------------------------------------------------------


def record(job: JobSpec, start: float, finish: float) -> JobRecord:
    return JobRecord(job, start, finish, 1.0, 0.0, 0.0, 0.0, 0)


def test_q_never_counts_urgent_and_l_divides_by_the_one_gpu_time() -> None:
    # LINEAR: 3600 s on one GPU. Normal e = 7200, Prior e = 3600 (1x), Urgent e = arrival.
    def task(name: str, qos: QosClass) -> JobSpec:
        return JobSpec(name, 0.0, 1, LINEAR, 3.6e6, 3_600_000, qos=qos)

    jobs = (
        record(task("u", QosClass.URGENT), 0.0, 10.0),  # started on arrival, still not met
        record(task("p", QosClass.PRIOR), 0.0, 3600.0),  # met exactly
        record(task("n", QosClass.NORMAL), 3600.0, 7300.0),  # 100 s late
    )
    result = SimResult("x", 16, jobs, 0.0, 0.0, 0)
    assert p3.qos_rate(result, 1.0) == pytest.approx(1 / 3)
    assert p3.qos_rate(result, 1.5) == pytest.approx(1 / 3)
    assert p3.qos_rate_urgent_on_arrival(result, 1.0) == pytest.approx(2 / 3)
    # L: (10/3600 + 3600/3600 + 3700/3600) / 3.
    assert p3.normalised_execution(result) == pytest.approx((10 + 3600 + 3700) / 3 / 3600)
    assert p3.normalised_response(result) == pytest.approx((10 + 3600 + 7300) / 3 / 3600)


def test_bounds_on_a_hand_made_queue() -> None:
    # One model without communication, 1000 samples/s per core at any batch, v = 0: a task of
    # 3.6e6 samples takes 3600/G s on G cores and 3600 GPU-seconds on any G.
    model = SyncTrainingModel("m", 0.0, 1e-3, 0.0, 1e9, 1e9, startup_s=0.0)
    profile = ModelProfile("m", (1000.0, 0.0, 0.0))

    def task(name: str, arrival: float, qos: QosClass) -> JobSpec:
        return JobSpec(name, arrival, 1, profile, 3.6e6, 3_600_000, 64, qos=qos, max_gpus=16)

    trace = Trace(
        (
            task("a", 0.0, QosClass.NORMAL),
            task("b", 7200.0, QosClass.PRIOR),
            task("c", 7200.0, QosClass.URGENT),
        )
    )
    limits = p3.bounds(trace, {"m": model}, prior_multiple=1.0)
    # Latest arrival + fastest (16 cores: 225 s) = 7425 s; work 3 x 3600 / 16 = 675 s.
    assert limits["makespan_h"] == pytest.approx(7425 / 3600)
    assert limits["qos_rate"] == pytest.approx(2 / 3)  # all but the Urgent task
    assert limits["load"] == pytest.approx(3 * 3600 / 16 / (24 * 3600))


def test_headline_picks_the_best_baseline_per_metric() -> None:
    row = {name: {"qos_rate": 0.2, "makespan_h": 50.0} for name in p3.BASELINES}
    row["tetris+cer"] = {"qos_rate": 0.5, "makespan_h": 40.0}
    row["fifo"] = {"qos_rate": 0.1, "makespan_h": 30.0}
    row[p3.P3] = {"qos_rate": 0.6, "makespan_h": 33.0}
    head = p3.headline(row)
    assert head.best_qos_baseline == "tetris+cer"
    assert head.qos_gain == pytest.approx(0.6 / 0.5 - 1)
    assert head.qos_points == pytest.approx(0.1)
    assert head.best_makespan_baseline == "fifo"
    assert head.makespan_change == pytest.approx(33 / 30 - 1)


def test_every_policy_runs_a_short_queue_to_the_end() -> None:
    runs = p3._Runs((0,))
    short = replace(p3.DEFAULT, size_scale=0.05)
    for name in (p3.P3, *p3.BASELINES, p3.ABLATION):
        result = runs.result(name, short, 10.0, 0)
        assert len(result.jobs) == len(runs.trace(short, 10.0, 0).jobs)
        assert all(r.finish >= r.first_start >= r.spec.arrival for r in result.jobs)


def test_the_report_states_what_its_runs_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small run of the whole report (short tasks, one seed, one sweep): the headline row
    and the verdicts are worked out here again from the JSON's policy means."""
    small = p3.Choices(size_scale=0.05)
    monkeypatch.setattr(p3, "DEFAULT", small)
    monkeypatch.setattr(p3, "SWEEPS", {"truth": ("k80", "predictor")})
    report = p3.run(seeds=(0,))
    data = report.data
    assert data["seeds"] == [0]
    for rate in p3.RATES:
        row = data["results"][str(rate)]
        best = max(p3.BASELINES, key=lambda n: row[n]["qos_rate"])
        gain = row[p3.P3]["qos_rate"] / row[best]["qos_rate"] - 1
        head = data["headline"][str(rate)]
        assert head["best_qos_baseline"] == best
        assert head["qos_gain"] == pytest.approx(gain)
        low, high = 0.6735, 0.6745  # +67.4 % as printed
        expected = "inside" if low <= gain <= high else "outside"
        assert data["verdicts"][str(rate)]["qos_gain"].startswith(expected)
        cells = next(
            line for line in report.markdown().splitlines() if line.startswith(f"| {rate:g}/h |")
        )
        assert p3.pct(gain) in cells and best in cells
    assert set(data["sweeps"]["truth"]) == {"k80", "predictor"}
    assert "TODO" not in report.markdown()
