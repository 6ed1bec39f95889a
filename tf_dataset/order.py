"""Epoch order: a seeded uniform shuffle in which files cached on this node are read first
*within bounded windows*. Pure logic, no TensorFlow.

The choice, and why. An epoch is a uniformly random permutation of the files (numpy's PCG64
seeded with ``(seed, epoch)``: deterministic given both, different every epoch). It is cut into
consecutive windows of ``window`` files, and inside each window the files cached on this node
come first, each group keeping its random order. So:

* *which* files form each window is exactly what a uniform shuffle gives, and no file moves more
  than ``window - 1`` places from its uniformly random position — the same displacement bound a
  downstream ``shuffle(buffer_size=window)`` works with, which (if the user adds one) also mixes
  the local and remote files of a window again;
* local files are read first in every window, from the page cache or the worker's RAM tier by
  short-circuit, while the remote files of the window — announced to the worker one window
  ahead as a prefetch hint — are being fetched.

The simpler "all local files first, then all remote ones" (``window >= len(files)``) is
available but not the default: which files are cached is often not random (a preload by
prefix caches whole class directories), so an epoch that reads every cached file first would
feed the model class-sorted batches for its first part. ``window=1`` is a plain uniform
shuffle.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

DEFAULT_WINDOW = 1024


def epoch_permutation(count: int, *, seed: int, epoch: int) -> np.ndarray:
    """A uniformly random permutation of ``range(count)``, a pure function of (seed, epoch)."""
    if count < 0 or seed < 0 or epoch < 0:
        raise ValueError("count, seed and epoch must be >= 0")
    return np.random.default_rng([seed, epoch]).permutation(count)


def windows(order: Sequence[int] | np.ndarray, window: int) -> Iterator[list[int]]:
    """Consecutive slices of ``window`` indices (the last may be shorter)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for start in range(0, len(order), window):
        yield [int(i) for i in order[start : start + window]]


def local_first(indices: Sequence[int], is_local: Sequence[bool]) -> list[int]:
    """``indices`` with the local ones first, both groups in their given order (a stable
    partition). ``is_local[k]`` says whether ``indices[k]`` is cached on this node."""
    if len(indices) != len(is_local):
        raise ValueError("indices and is_local differ in length")
    local = [i for i, here in zip(indices, is_local, strict=True) if here]
    remote = [i for i, here in zip(indices, is_local, strict=True) if not here]
    return local + remote


def epoch_order(
    is_local: Sequence[bool],
    *,
    seed: int,
    epoch: int,
    window: int = DEFAULT_WINDOW,
    shuffle: bool = True,
) -> list[int]:
    """The whole order of one epoch over ``len(is_local)`` files (see the module docstring).
    Without ``shuffle`` the files keep their given order: no locality reordering either."""
    count = len(is_local)
    if not shuffle:
        return list(range(count))
    order: list[int] = []
    for chunk in windows(epoch_permutation(count, seed=seed, epoch=epoch), window):
        order += local_first(chunk, [is_local[i] for i in chunk])
    return order
