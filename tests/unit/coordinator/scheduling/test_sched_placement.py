"""Placement helpers, checked against P2's best-fit algorithm worked by hand."""

from __future__ import annotations

from coordinator.scheduling.placement import (
    best_fit,
    best_fit_many,
    first_fit,
    place_shape,
    symmetric_shapes,
)


def test_best_fit_takes_the_tightest_node_that_holds_the_job() -> None:
    # Nodes sorted ascending by free GPUs: B(1), C(2), A(3); the first holding 2 GPUs is C.
    assert best_fit({"A": 3, "B": 1, "C": 2}, 2) == {"C": 2}
    assert best_fit({"A": 3, "B": 1, "C": 2}, 1) == {"B": 1}
    assert best_fit({"A": 3, "B": 1, "C": 2}, 3) == {"A": 3}


def test_best_fit_splits_from_the_node_with_most_free_gpus() -> None:
    # 5 GPUs fit on no node: A (most free, 3) gives 3; the remaining 2 then fit on C.
    assert best_fit({"A": 3, "B": 1, "C": 2}, 5) == {"A": 3, "C": 2}
    # 4 GPUs: A gives 3; the remaining 1 fits on B, the tightest.
    assert best_fit({"A": 3, "B": 1, "C": 2}, 4) == {"A": 3, "B": 1}


def test_best_fit_refuses_what_does_not_fit() -> None:
    assert best_fit({"A": 1, "B": 1}, 3) is None
    assert best_fit({"A": 0}, 1) is None


def test_best_fit_many_places_largest_jobs_first() -> None:
    # Largest first: j4 (4) fits only on A(4); then j2 (2) takes C(2); then j1 (1) takes B(1).
    placements = best_fit_many({"A": 4, "B": 1, "C": 2}, {"j1": 1, "j2": 2, "j4": 4})
    assert placements == {"j4": {"A": 4}, "j2": {"C": 2}, "j1": {"B": 1}}
    assert best_fit_many({"A": 2}, {"j1": 2, "j2": 1}) is None


def test_best_fit_with_a_locality_preference() -> None:
    cached = {"A": 0.0, "B": 50.0, "C": 10.0}
    # Among nodes that hold 1 GPU, the one with the most cached data wins over the tightest.
    assert best_fit({"A": 1, "B": 3, "C": 2}, 1, cached.__getitem__) == {"B": 1}


def test_first_fit_prefers_a_whole_node_then_name_order() -> None:
    assert first_fit({"b": 4, "a": 2}, 3) == {"b": 3}
    assert first_fit({"b": 2, "a": 2}, 3) == {"a": 2, "b": 1}


def test_symmetric_shapes_are_p3s_feasible_shapes() -> None:
    shapes = symmetric_shapes({"A": 4, "B": 2, "C": 1}, 4)
    assert set(shapes) == {(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3), (1, 4)}
    assert place_shape({"A": 4, "B": 2, "C": 1}, 2, 2) == {"B": 2, "A": 2}
    assert place_shape({"A": 4, "B": 2, "C": 1}, 2, 3) is None
