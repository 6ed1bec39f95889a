"""How many store requests to keep in flight: an adaptive limit per purpose.

A fixed count is wrong both ways: too few GETs in flight leave a store with tens of
milliseconds of latency idle (each GET is mostly waiting), too many make a store that is
throttling us answer "503 SlowDown" to more and more of them. :class:`AdaptiveConcurrency`
finds the count as TCP Reno finds its window:

- *slow start*: until the store first says "slow down", every success adds one request, so
  the limit doubles per round trip, up to the ceiling;
- *additive increase*: after that, one more request per ``limit`` successes in a row (one per
  round of the current window);
- *multiplicative decrease*: a throttling answer (:class:`~cachefs.errors.StoreThrottled`:
  503, 429, SlowDown and kin, classified by :func:`cachefs.store.retry.is_throttling`) cuts
  the limit to :data:`DECREASE_FACTOR` of itself, never below the floor. The next ``limit``
  answers after a cut do not cut again: they were sent before it, and one overload burst is
  one signal.

Only the store's "slow down" lowers the limit, never this node's own queueing. A latency test
(TCP Vegas: cut when answers take longer than the fastest recent round, reading the extra time
as requests waiting here) held the preload at 5–6 in flight store-direct and 22–28 behind a
20 ms proxy on the 2-core reference machine; at the ceiling's 64 the same preload ran 13–19 %
and 11–57 % faster, at less CPU per block, because the fetchers and the pipeline then handle
answers in batches (bench/results/store_fetch_rate/2026-11-29-no-vegas.md). The ceiling bounds
the memory a preload holds in flight.

The decisions depend only on the answers handed in, never on a clock, so a run is
deterministic given them (tests/e2e/store/test_concurrency.py steps through one). Two ways to
apply the limit: :class:`AdaptiveConcurrency` applies it to a ``trio.CapacityLimiter``
(``total_tokens`` can be changed live: borrowers above a lowered limit keep their tokens, new
ones wait), so its methods run on the trio loop (the read path's GETs);
:class:`ThreadedConcurrency` is the same limit for plain threads (``acquire``/``release``
around each request, every method thread-safe: the preload's fetch pipelines,
cachefs/cluster/pipeline.py).

Stores retry throttled tries themselves (:class:`~cachefs.store.retry.HedgedReads`) and count
them (``throttled_tries``); a caller hands the limit the growth of that count over its
request: :func:`throttled_tries` reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import trio

from cachefs.store.retry import ATTEMPT_THREADS

#: What a throttling answer leaves of the limit.
DECREASE_FACTOR = 0.5


@dataclass(frozen=True, slots=True)
class ConcurrencyBounds:
    """Where an adaptive limit starts, and the range it moves in."""

    initial: int
    floor: int
    ceiling: int

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.initial <= self.ceiling:
            raise ValueError(
                f"store concurrency needs 1 <= floor <= initial <= ceiling, not "
                f"{self.floor}, {self.initial}, {self.ceiling}"
            )


#: Preload fetches per node (cluster and single node). The ceiling bounds the memory a preload
#: holds in flight: up to ``ceiling`` blocks (64 blocks of 4 MiB: 256 MiB).
PRELOAD_BOUNDS = ConcurrencyBounds(initial=16, floor=2, ceiling=64)
#: GETs of reads through the mount and of fills that fall back to the store. Each may hedge
#: (two tries at once), so the ceiling keeps every try on a thread of the store's pool.
READ_BOUNDS = ConcurrencyBounds(initial=32, floor=4, ceiling=ATTEMPT_THREADS // 2)


def throttled_tries(store: Any) -> int:
    """How many tries ``store`` has seen answered "slow down" (0 for a store that is never
    throttled, such as a local directory)."""
    return getattr(store, "throttled_tries", 0)


class AdaptiveLimit:
    """The adaptive limit's decisions (see the module docstring); the subclasses apply it.
    Call :meth:`record` once per answered request."""

    def __init__(self, bounds: ConcurrencyBounds, *, purpose: str):
        self.bounds = bounds
        self.purpose = purpose  # "preload", "read": the metric's label
        self.limit = bounds.initial
        self.peak = bounds.initial
        self.throttled = 0  # answers that were throttled (or saw a throttled try)
        self.decreases = 0
        self._slow_start = True
        self._successes = 0  # in a row, since the last change of the limit
        self._hold = 0  # answers still to come from before the last cut: they cut no more

    @property
    def in_flight(self) -> int:
        raise NotImplementedError

    def _applied(self, limit: int) -> None:
        """The limit changed to ``limit``: the subclass applies it."""

    def record(self, *, throttled: bool) -> None:
        """One request answered: ``throttled`` if the store said "slow down" to it (to any of
        its tries)."""
        if throttled:
            self.throttled += 1
        holding = self._hold > 0
        if holding:
            self._hold -= 1
        if throttled and not holding:
            self._cut()
            return
        if not throttled:
            self._successes += 1
            if self._slow_start or self._successes >= self.limit:
                self._set(self.limit + 1)

    def _cut(self) -> None:
        self._slow_start = False
        self._hold = self.limit  # as many as may be in flight now
        self.decreases += 1
        self._set(int(self.limit * DECREASE_FACTOR))

    def _set(self, limit: int) -> None:
        limit = max(self.bounds.floor, min(self.bounds.ceiling, limit))
        self._successes = 0
        if limit != self.limit:
            self.limit = limit
            self.peak = max(self.peak, limit)
            self._applied(limit)

    def report(self) -> dict[str, int]:
        """For status documents and metrics."""
        return {
            "limit": self.limit,
            "peak": self.peak,
            "in_flight": self.in_flight,
            "throttled": self.throttled,
            "decreases": self.decreases,
        }


class AdaptiveConcurrency(AdaptiveLimit):
    """The adaptive limit applied to :attr:`limiter`, a ``trio.CapacityLimiter``: borrow a token
    per request; every method runs on the trio loop."""

    def __init__(self, bounds: ConcurrencyBounds, *, purpose: str):
        super().__init__(bounds, purpose=purpose)
        self.limiter = trio.CapacityLimiter(bounds.initial)

    @property
    def in_flight(self) -> int:
        return self.limiter.borrowed_tokens

    def _applied(self, limit: int) -> None:
        self.limiter.total_tokens = limit


class ThreadedConcurrency(AdaptiveLimit):
    """The adaptive limit for plain threads: :meth:`acquire` a place before each request,
    :meth:`release` it when answered, :meth:`record` the answer; all thread-safe. Several
    threads share one (all the preload's pipelines: one limit per node)."""

    def __init__(self, bounds: ConcurrencyBounds, *, purpose: str):
        super().__init__(bounds, purpose=purpose)
        self._changed = threading.Condition()  # guards the limit's state and _in_flight
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def acquire(self, timeout: float) -> bool:
        """Take a place under the limit, waiting up to ``timeout`` seconds for one; whether
        one was taken."""
        with self._changed:
            if self._in_flight >= self.limit:
                self._changed.wait(timeout)
                if self._in_flight >= self.limit:
                    return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        with self._changed:
            self._in_flight -= 1
            self._changed.notify()

    def record(self, *, throttled: bool) -> None:
        with self._changed:
            super().record(throttled=throttled)

    def _applied(self, limit: int) -> None:
        # Called under the lock, from record(): a raised limit frees places.
        self._changed.notify_all()

    def report(self) -> dict[str, int]:
        with self._changed:
            return super().report()
