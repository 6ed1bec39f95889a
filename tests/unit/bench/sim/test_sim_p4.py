"""P4's reproduction: the ground truth taken from the paper's text, and the accuracy experiment."""

from __future__ import annotations

import math

import pytest

from bench.sim.experiments import p4


def test_table_1_sums_with_equations_2_to_5() -> None:
    flops, memory = p4.table_1_totals()
    # The FLOPS column: 9106944 + 120422400 + 43352064 + 65028096 + 43352064 + 51380224
    # + 16777216 + 40960 (the text rounds the total to "約334MFLOPS").
    assert flops == 349_459_968
    # Weights (71,920,992) and every layer's output (475,034 values), float32: "約289MB".
    assert memory == 4 * (71_920_992 + 475_034) == 289_584_104


def test_measured_times_follow_the_papers_percentages() -> None:
    alone = p4._plan("single", "gtx1080")
    assert p4.MEASURED[alone] == 1.0
    # "時間消耗上前者比後者降低了54.5%": the GTX 1080 alone took 45.5 % of a GTX 970's time.
    assert p4.MEASURED[p4._plan("single", "gtx970-a")] * 0.455 == pytest.approx(1.0)
    # Figure 6: the GTX 1080 alone was 8.1 % below 970 + 970 sync and 2.3 % below 1080 + 970
    # async.
    two_970_sync = p4.MEASURED[p4._plan("sync", "gtx970-a", "gtx970-b")]
    assert two_970_sync * (1 - 0.081) == pytest.approx(1.0)
    assert p4.MEASURED[p4._plan("async", "gtx1080", "gtx970-b")] * (1 - 0.023) == pytest.approx(1)
    # Figure 4: 970 + 970 sync took 59.3 % of the sync sets with the GTX 1080.
    with_1080 = p4.MEASURED[p4._plan("sync", "gtx1080", "gtx970-a", "gtx970-b")]
    assert two_970_sync / with_1080 == pytest.approx(0.593)
    # Figure 5: 970 + 970 async took 6.2 % more than the async sets with the GTX 1080.
    ratio = (
        p4.MEASURED[p4._plan("async", "gtx970-a", "gtx970-b")]
        / p4.MEASURED[p4._plan("async", "gtx1080", "gtx970-a")]
    )
    assert ratio == pytest.approx(1.062)
    assert len(p4.MEASURED) == 11 and min(p4.MEASURED, key=p4.MEASURED.__getitem__) == alone


def test_the_prediction_for_the_papers_job() -> None:
    # One synchronisation per mini-batch of 128: T_trans alone is 469·50·23.12 s, so the GTX
    # 1080 alone (the paper's own prediction, section 4.2).
    plan, allocation = p4.predicted_plan(469)
    assert plan == p4._plan("single", "gtx1080")
    tau = 3 * 334e6 * 50 * 60_000 / (352e9 * (334e6 / 289e6))
    assert allocation.seconds == pytest.approx(tau)
    # One per epoch: three nodes, each a third of the work; the GTX 970 is the slowest:
    # τ/3 · 352/232 + 50 · 8 · 289e6 / 100e6 s, less than τ; step 7 names it asynchronous.
    plan, allocation = p4.predicted_plan(1)
    assert plan == p4._plan("async", "gtx1080", "gtx970-a", "gtx970-b")
    assert allocation.seconds == pytest.approx(tau / 3 * 352 / 232 + 50 * 8 * 289e6 / 100e6)


def test_accuracy_thresholds_agree_with_direct_trials() -> None:
    predicted = p4._plan("single", "gtx1080")
    thresholds = p4.win_thresholds(predicted, rows=4000, seed=3)
    assert p4.expected_accuracy(thresholds, 0.0) == 1.0
    values = [p4.expected_accuracy(thresholds, noise) for noise in (0.005, 0.01, 0.02, 0.05)]
    assert values == sorted(values, reverse=True) and values[-1] < 0.5
    for noise in (0.01, 0.03):
        direct, counts = p4.identical_trials(predicted, noise, trials=4000, seed=5)
        assert sum(counts.values()) == 4000
        # Two estimates of the same probability from 4000 draws each (standard error < 0.8 %).
        assert abs(direct - p4.expected_accuracy(thresholds, noise)) < 0.035
    # The σ at which the expected accuracy is 91.6 % gives back about 91.6 %.
    implied = p4.noise_for(thresholds, 0.916)
    assert p4.expected_accuracy(thresholds, implied) == pytest.approx(0.916, abs=0.002)
    # A plan that is not the measured best never wins without noise.
    assert p4.win_thresholds(p4._plan("single", "gtx970-a"), rows=10)[-1] == 0.0


def test_report_states_this_runs_numbers() -> None:
    report = p4.run(trials=200)
    data = report.data
    assert data["predicted_plan"] == "gtx1080 (single)"
    assert data["measured_best"] == "gtx1080 (single)"
    implied = data["implied_noise"]
    assert 0 < implied < 0.05 and math.isfinite(implied)
    assert f"σ ≈ {implied * 100:.2f} % per run" in report.markdown()
