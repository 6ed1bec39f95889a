"""The reports' verdicts: inside or outside a paper's range, computed from the numbers."""

from __future__ import annotations

import pytest

from bench.sim.report import above, below, figure, verdict


@pytest.mark.parametrize(
    ("ours", "paper", "expected"),
    [
        (2.2, (2.2, 3.7), "inside"),  # a range includes its ends, 2.2 in binary too
        (3.7, (2.2, 3.7), "inside"),
        (2.19, (2.2, 3.7), "outside (below)"),
        (3.71, (2.2, 3.7), "outside (above)"),
        (0.9165, figure(0.916, 0.001), "inside"),  # rounds to 91.6 %
        (0.9155, figure(0.916, 0.001), "inside"),
        (0.917, figure(0.916, 0.001), "outside (above)"),
        (-0.457, figure(-0.40, 0.01), "outside (below)"),  # signed: a larger cut is below
        (408.32e9, figure(408.32e9, 0.01e9), "inside"),
        (2.25, above(2.25), "outside (below)"),  # "> 2.25x" excludes 2.25
        (2.2501, above(2.25), "inside"),
        (0.05, below(0.05), "outside (above)"),  # "< 5 %" excludes 5 %
        (0.048, below(0.05), "inside"),
    ],
)
def test_verdict_of_one_value(ours: float, paper: tuple[float, float], expected: str) -> None:
    assert verdict(ours, paper) == expected


def test_verdict_of_several_values_counts_the_ones_outside() -> None:
    assert verdict([2.54, 2.47, 2.46, 3.14], (2.2, 3.7)) == "inside (all 4)"
    assert verdict([0.0, 0.0, 0.05], (0.04, 0.07)) == "outside (2 of 3: below)"
    assert verdict([1.0, 5.0, 0.5], (0.8, 2.0)) == "outside (2 of 3: below and above)"
