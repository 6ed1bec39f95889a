"""The plain-Python least squares behind P2's and P3's fits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.scheduling.fitting import least_squares, nonnegative_least_squares
from coordinator.scheduling.model import SchedulingError


def residual(rows: list[list[float]], targets: list[float], coeffs: list[float]) -> float:
    return sum(
        (sum(c * x for c, x in zip(coeffs, r, strict=True)) - t) ** 2
        for r, t in zip(rows, targets, strict=True)
    )


def test_exact_data_is_recovered() -> None:
    rows = [[1.0, x, x * x] for x in (16, 32, 64, 128, 256)]
    targets = [300 + 2 * x - 0.005 * x * x for x in (16, 32, 64, 128, 256)]
    assert least_squares(rows, targets) == pytest.approx([300, 2, -0.005])


def test_dependent_columns_are_refused() -> None:
    with pytest.raises(SchedulingError, match="do not pin down"):
        least_squares([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 10), st.floats(0.1, 10), st.floats(-20, 20)),
        min_size=3,
        max_size=8,
    )
)
def test_nonnegative_fit_is_no_worse_than_any_nonnegative_grid_point(
    points: list[tuple[float, float, float]],
) -> None:
    rows = [[x, y] for x, y, _ in points]
    targets = [t for _, _, t in points]
    coeffs = nonnegative_least_squares(rows, targets)
    assert min(coeffs) >= 0
    best = residual(rows, targets, coeffs)
    grid = [i / 4 for i in range(0, 41)]
    for a, b in itertools.product(grid, grid):
        assert best <= residual(rows, targets, [a, b]) + 1e-6 * (1 + best)
