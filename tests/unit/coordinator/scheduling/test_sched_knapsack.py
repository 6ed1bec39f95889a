"""P2's knapsacks and epoch-time fit: the DP against brute force, the fit against known curves."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.scheduling.elastic import fit_epoch_time
from coordinator.scheduling.knapsack import solve_grouped_knapsack

values = st.floats(min_value=-50, max_value=50, allow_nan=False, allow_infinity=False)
job_options = st.lists(values, min_size=1, max_size=5).map(lambda v: [0.0, *v[1:]])


def brute_force(options: list[list[float]], capacity: int, exact: bool) -> float | None:
    best = None
    for choice in itertools.product(*(range(len(o)) for o in options)):
        used = sum(choice)
        if used > capacity or (exact and used != capacity):
            continue
        total = sum(o[k] for o, k in zip(options, choice, strict=True))
        best = total if best is None else max(best, total)
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(job_options, min_size=1, max_size=4), st.integers(0, 8), st.booleans())
def test_dp_equals_brute_force(options: list[list[float]], capacity: int, exact: bool) -> None:
    expected = brute_force(options, capacity, exact)
    if expected is None:
        with pytest.raises(ValueError, match="exactly"):
            solve_grouped_knapsack(options, capacity, exact=exact)
        return
    total, taken = solve_grouped_knapsack(options, capacity, exact=exact)
    assert total == pytest.approx(expected)
    # The back-tracked choice is feasible and really achieves the reported total.
    assert all(0 <= k < len(o) for o, k in zip(options, taken, strict=True))
    assert sum(taken) == capacity if exact else sum(taken) <= capacity
    assert sum(o[k] for o, k in zip(options, taken, strict=True)) == pytest.approx(total)


def test_expansion_example_by_hand() -> None:
    # Two jobs, 3 idle GPUs: job A gains 10, 15, 16 for +1/+2/+3; job B gains 8, 9, 9.5.
    # Best: A +2 (15) and B +1 (8) = 23.
    total, taken = solve_grouped_knapsack([[0, 10, 15, 16], [0, 8, 9, 9.5]], 3)
    assert (total, taken) == (23, [2, 1])


def test_reduction_must_reclaim_exactly() -> None:
    # Reclaim 2 GPUs; losses (negated) per job for -1/-2: A loses 5 then 12, B loses 4 then 20.
    total, taken = solve_grouped_knapsack([[0, -5, -12], [0, -4, -20]], 2, exact=True)
    assert (total, taken) == (-9, [1, 1])


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="negative"):
        solve_grouped_knapsack([[0.0]], -1)
    with pytest.raises(ValueError, match="option 0"):
        solve_grouped_knapsack([[]], 1)


def test_epoch_time_fit_recovers_a_known_curve() -> None:
    def truth(g: int) -> float:
        return 1200 / g + 30 + 4 * g

    fitted = fit_epoch_time([(g, truth(g)) for g in (1, 2, 4, 8)], default=lambda g: 1.0)
    for g in range(1, 13):
        assert fitted(g) == pytest.approx(truth(g), rel=1e-6)


def test_epoch_time_fit_keeps_coefficients_non_negative() -> None:
    # Noisy points that an unconstrained fit would bend into a negative overhead.
    fitted = fit_epoch_time([(1, 100.0), (2, 45.0), (4, 20.0)], default=lambda g: 1.0)
    assert all(fitted(g) > 0 for g in range(1, 64))


def test_epoch_time_with_one_gpu_count_scales_the_default() -> None:
    fitted = fit_epoch_time([(2, 50.0), (2, 70.0)], default=lambda g: 120.0 / g)
    assert fitted(2) == pytest.approx(60.0)
    assert fitted(4) == pytest.approx(30.0)


def test_epoch_time_without_observations_is_the_default() -> None:
    def default(g: int) -> float:
        return 10.0 / g

    assert fit_epoch_time([], default) is default
