"""Least squares for the policies' tiny models (2–3 coefficients), in plain Python.

The coordinator does not depend on numpy or scipy: P2's epoch-time model and P3's throughput
and communication fits have at most three unknowns, where solving the normal equations and, for
non-negative fits, trying every set of free coefficients (the active-set answer, exact for so
few unknowns) is cheap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .model import SchedulingError


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Coefficients minimising Σ (row · coeffs − target)², by the normal equations."""
    width = len(rows[0])
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(width)] for i in range(width)]
    moment = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) for i in range(width)]
    return _solve(gram, moment)


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float]
) -> list[float]:
    """Least squares with every coefficient ≥ 0: the best unconstrained fit over each subset
    of coefficients allowed to be non-zero, among those whose coefficients are all ≥ 0."""
    width = len(rows[0])
    best: tuple[float, list[float]] = (_residual(rows, targets, [0.0] * width), [0.0] * width)
    for size in range(1, width + 1):
        for free in itertools.combinations(range(width), size):
            try:
                partial = least_squares([[r[i] for i in free] for r in rows], targets)
            except SchedulingError:
                continue  # these columns are dependent on this data
            if min(partial) < 0:
                continue
            coeffs = [0.0] * width
            for index, value in zip(free, partial, strict=True):
                coeffs[index] = value
            residual = _residual(rows, targets, coeffs)
            if residual < best[0] - 1e-12 * max(1.0, best[0]):
                best = (residual, coeffs)
    return best[1]


def _residual(
    rows: Sequence[Sequence[float]], targets: Sequence[float], coeffs: list[float]
) -> float:
    return sum(
        (sum(c * x for c, x in zip(coeffs, row, strict=True)) - t) ** 2
        for row, t in zip(rows, targets, strict=True)
    )


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; refuses a (near-)singular system."""
    size = len(rhs)
    a = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    scale = max(abs(x) for row in matrix for x in row) or 1.0
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            raise SchedulingError("least squares: the measurements do not pin down the model")
        a[col], a[pivot] = a[pivot], a[col]
        for row in range(col + 1, size):
            factor = a[row][col] / a[col][col]
            for k in range(col, size + 1):
                a[row][k] -= factor * a[col][k]
    solution = [0.0] * size
    for row in range(size - 1, -1, -1):
        known = sum(a[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (a[row][size] - known) / a[row][row]
    return solution
