"""The epoch order of tf_dataset (pure logic, no TensorFlow, no worker)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from scipy import stats

from tf_dataset.order import epoch_order, epoch_permutation, local_first, windows


def test_permutation_is_deterministic_per_seed_and_epoch_and_differs_between_them():
    first = epoch_permutation(1000, seed=3, epoch=0)
    assert sorted(first.tolist()) == list(range(1000))
    assert first.tolist() == epoch_permutation(1000, seed=3, epoch=0).tolist()
    assert first.tolist() != epoch_permutation(1000, seed=3, epoch=1).tolist()
    assert first.tolist() != epoch_permutation(1000, seed=4, epoch=0).tolist()


def test_local_first_is_a_stable_partition():
    assert local_first([5, 1, 4, 2, 3], [False, True, False, True, True]) == [1, 2, 3, 5, 4]
    with pytest.raises(ValueError):
        local_first([1, 2], [True])


@pytest.mark.parametrize("window", [1, 7, 64, 10_000])
def test_every_window_holds_its_local_files_first_and_the_same_files_as_the_shuffle(window):
    rng = random.Random(window)
    local = [rng.random() < 0.3 for _ in range(1000)]
    order = epoch_order(local, seed=1, epoch=2, window=window)
    shuffled = epoch_permutation(1000, seed=1, epoch=2).tolist()
    assert sorted(order) == list(range(1000))
    for start in range(0, 1000, window):
        part = order[start : start + window]
        assert set(part) == set(shuffled[start : start + window])
        flags = [local[i] for i in part]
        assert flags == sorted(flags, reverse=True), "a remote file before a local one"
        # Within each group, the uniform shuffle's order is kept.
        for group in (True, False):
            members = [i for i in part if local[i] == group]
            assert members == [i for i in shuffled[start : start + window] if local[i] == group]


def test_without_shuffle_the_order_is_the_given_one():
    assert epoch_order([False, True, False], seed=0, epoch=5, shuffle=False) == [0, 1, 2]


def test_windows_cover_the_order_once():
    assert list(windows([4, 3, 2, 1, 0], 2)) == [[4, 3], [2, 1], [0]]
    with pytest.raises(ValueError):
        list(windows([1], 0))


def test_positions_are_uniform_across_epochs():
    """Which file lands in which window is uniform: over many epochs, each of 8 files is in
    the first half of the order as often as chance says, local or not (chi-square)."""
    local = [True, False] * 4
    counts = Counter()
    epochs = 4000
    for epoch in range(epochs):
        order = epoch_order(local, seed=9, epoch=epoch, window=4)
        counts.update(order[:4])
    observed = [counts[i] for i in range(8)]
    expected = [epochs / 2] * 8
    assert stats.chisquare(observed, expected).pvalue > 1e-4
