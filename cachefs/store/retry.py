"""The retry loops of the object-store layer, and the checks that decide what they retry.

SDK-level retries are switched off (boto3) or bypassed (oss2's iterators) so that every store
call is retried here, with one policy (:class:`~cachefs.store.base.RetryPolicy`) and one place
that decides what "transient" means: a :class:`~cachefs.errors.StoreError` whose ``transient``
attribute is true (in practice :class:`~cachefs.errors.StoreUnavailable`). Two loops share that
policy and its backoff:

- :func:`call_with_retries` runs a call in the calling thread and retries it after failures:
  for HEAD and LIST pages, whose tries the SDK's socket timeouts bound.
- :class:`HedgedReads` runs each try of a *read* on a thread of its own pool, so that a try
  that stalls can be raced (hedged) and abandoned instead of eating the whole budget; a
  client whose tries can bound their own wait for the answer's headers (the lean S3 client)
  runs the first try on the calling thread instead, and only a try that fails goes to the
  pool.

Everything here is blocking; it runs in worker threads, never on the trio loop.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import urllib3.exceptions

from cachefs.errors import StoreError, StoreIOError, StoreThrottled, StoreUnavailable
from cachefs.store.base import RetryPolicy
from cachefs.threads import LazyThreads

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads per store for the tries of hedged reads. Enough for the worker's store threads
#: (``ReadLimits.store_threads``, 32) with a hedge each, plus abandoned tries winding down;
#: a try that finds them all busy waits in the pool, and its first-byte clock starts only
#: when it runs.
ATTEMPT_THREADS = 96


#: HTTP statuses and error codes by which S3 and S3-like stores (OSS included) say "too many
#: requests, slow down". The one list: the stores' error mappings ask :func:`is_throttling`.
THROTTLING_STATUSES = frozenset({429, 503})
THROTTLING_CODES = frozenset(
    {
        "SlowDown",  # S3's 503
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "QpsLimitExceeded",  # OSS: the bucket's request rate limit
        "ServerBusy",  # OSS
    }
)


def is_throttling(status: int, code: str) -> bool:
    """Whether an error answer (HTTP ``status``, the store's error ``code``) asks us to slow
    down: a :class:`~cachefs.errors.StoreThrottled`, which the adaptive concurrency limits
    answer by sending fewer requests at once."""
    return status in THROTTLING_STATUSES or code in THROTTLING_CODES


class ShortBody(StoreUnavailable):
    """A response body ended before the promised length (connection cut mid-body).

    Transient, so the retry loop tries again; if every try is short,
    :meth:`HedgedReads.call` turns it into a :class:`StoreIOError`.
    """


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    jitter: Callable[[], float] = random.random,
) -> T:
    """Call ``fn()`` until it succeeds, retrying transient store errors.

    Backoff is "full jitter" exponential: before try ``n+1`` sleep ``jitter() * min(max_delay,
    base_delay * 2**(n-1))`` (``jitter`` returns a number in [0, 1)), which spreads the retries
    of many concurrent readers instead of having them hammer a struggling store in lockstep.
    Gives up after ``policy.attempts`` tries, or earlier when the next sleep would end past
    ``policy.deadline_s`` since the first try; the last error is then re-raised (same type, same
    dataset/key/store) with a message saying how many tries were made. Non-transient errors and
    non-store exceptions propagate at once. ``what`` names the operation in messages and logs,
    e.g. ``"GET train/a.jpg"``. ``sleep``, ``clock`` and ``jitter`` exist for tests.
    """
    started = clock()
    tries = 0
    while True:
        tries += 1
        try:
            return fn()
        except StoreError as err:
            if not err.transient:
                raise
            elapsed = clock() - started
            delay = backoff_s(policy, tries, jitter)
            if tries >= policy.attempts or elapsed + delay > policy.deadline_s:
                raise _gave_up(err, what=what, tries=tries, elapsed=elapsed) from err
            log.info(
                "%s failed (try %d of %d), retrying in %.2f s: %s",
                what,
                tries,
                policy.attempts,
                delay,
                err,
            )
            sleep(delay)


def backoff_s(policy: RetryPolicy, failures: int, jitter: Callable[[], float]) -> float:
    """The pause after the ``failures``-th failure: "full jitter" exponential backoff."""
    growth: int = 2 ** (failures - 1)  # failures >= 1: an int (typeshed says Any for int ** int)
    return jitter() * min(policy.max_delay_s, policy.base_delay_s * growth)


class AttemptAbandoned(Exception):
    """Raised inside a try that lost (another try answered, or the budget ran out) to stop it
    before its body, or between chunks of it; :class:`HedgedReads` swallows it."""


class Attempt:
    """One try of a hedged read, as the function doing it sees it.

    The function calls :meth:`first_byte` once the store has started answering (response
    headers in), and :meth:`check_abandoned` before it reads the body.

    Progress is kept in plain attributes, written by the try's thread and read by the caller's
    when one of its timers fires (single attribute stores are atomic in CPython): a read that
    goes well wakes its caller once, with its outcome, however many steps it took.

    A try run on the calling thread (``HedgedReads(inline_first_try=True)``) has no timer
    watching it: its ``head_timeout_s`` bounds its connect and its wait for the answer's
    headers instead, and the function doing it must apply it.
    """

    def __init__(self, number: int, *, head_timeout_s: float | None = None):
        self.number = number  # 1 for the first try of a read
        self.began_at: float | None = None  # when it began: on a pool thread, or inline
        self.answered = False  # its first byte came
        self.abandoned = False  # it lost; the caller set this, the try's thread reads it
        self.head_timeout_s = head_timeout_s  # None: the client's own timeouts

    def first_byte(self) -> None:
        self.answered = True

    def check_abandoned(self) -> None:
        if self.abandoned:
            raise AttemptAbandoned(f"try {self.number} lost")

    def abandon(self) -> None:
        self.abandoned = True

    def silent_for(self, now: float) -> float:
        """How long it has waited for its first byte (0 if it answered or has not begun)."""
        began_at = self.began_at
        if self.answered or began_at is None:
            return 0.0
        return now - began_at


@dataclass
class _Outcome:
    attempt: Attempt | None  # None: no try's outcome, the store was closed
    result: Any = None  # what the try's read returned (a T of its _OneRead[T])
    error: BaseException | None = None


#: What :meth:`HedgedReads.close` tells every read still waiting.
_CLOSED = _Outcome(attempt=None)


#: How often a caller looks again at a try still waiting for a pool thread (a saturated pool:
#: its first-byte clock has not started).
_NOT_BEGUN_POLL_S = 0.05


class HedgedReads:
    """Runs reads as hedged tries on threads it owns (one set per store).

    For each read, under ``policy`` (all numbers from :class:`~cachefs.store.base.RetryPolicy`):

    - a try that has not started answering after ``hedge_after_s`` gets a twin, run in
      parallel: whichever completes first wins, the other is abandoned (never more than two
      tries run at once for one read);
    - a try still silent after ``attempt_timeout_s`` is abandoned and replaced at once;
    - a try that fails transiently (5xx, reset, a body cut short or stalled mid-way: the SDK's
      read timeout is the same ``attempt_timeout_s``) is replaced after a jittered backoff;
    - a permanent failure (ObjectChanged, ObjectNotFound, ...) ends the read at once;
    - after ``attempts`` tries, or at ``deadline_s``, the read gives up with one line naming
      the last failure, the number of tries and the time spent.

    Every try of a read sends the same request (the etag precondition included), so a hedge
    can never mix bytes of two object versions.

    With ``inline_first_try`` the first try runs on the calling thread, not on the pool: a
    read that goes well then costs no hand-off between threads (two wake-ups, and the GIL
    passed between them). With 16 threads reading 110 KB objects from a store on the same
    2-core machine, that hand-off was half of the lean client's CPU per GET
    (bench/results/store_fetch_rate/2026-11-29-inline-try.md).
    Nothing watches that try, so it bounds its own connect and wait for the answer's headers
    by ``hedge_after_s`` (:attr:`Attempt.head_timeout_s`; the client must honour it, as
    cachefs/store/s3_bulk.py does) and its mid-body stalls by ``attempt_timeout_s`` like any
    try. If it fails, the read goes on as above on the pool's threads: a permanent failure
    ends it, a transient one (a head that did not come within ``hedge_after_s`` is one) is
    retried after the backoff. The one difference from a read whose first try ran on the
    pool: a first try silent for ``hedge_after_s`` is cut and replaced instead of raced by a
    twin until ``attempt_timeout_s``.

    How an abandoned try ends: it is a blocking SDK call on a pool thread and cannot be
    interrupted, so its own timeouts end it — the connect and read timeouts the store gives
    its SDK client (``attempt_timeout_s``) end a silent or stalled one; one whose headers come
    after it lost stops before its body (:meth:`Attempt.check_abandoned`), one already reading
    its body ends with it (a block at most). Its outcome is dropped.
    :meth:`close` ends every waiting read at once ("the store was closed") and lets the
    pool's threads go once their tries have ended; :attr:`in_flight` counts tries not ended
    yet, abandoned ones included (a try dropped from the pool's queue by :meth:`close` ends
    then).
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        name: str,
        threads: int = ATTEMPT_THREADS,
        inline_first_try: bool = False,
        jitter: Callable[[], float] = random.random,
    ):
        self.policy = policy
        self.inline_first_try = inline_first_try
        self._threads = LazyThreads(threads, name, self._run, self._ended)
        self._jitter = jitter  # for tests
        self._lock = threading.Lock()
        self._in_flight = 0
        self._throttled_tries = 0
        self._closed = False
        self._waiting: set[queue.SimpleQueue[_Outcome]] = set()  # the outcomes of reads not ended

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def throttled_tries(self) -> int:
        """Tries answered "slow down" (:class:`~cachefs.errors.StoreThrottled`) so far, every
        read together: the adaptive concurrency limits watch it grow."""
        with self._lock:
            return self._throttled_tries

    def _throttled(self) -> None:
        with self._lock:
            self._throttled_tries += 1

    def close(self) -> None:
        """No new reads; waiting reads end at once with "the store was closed"; queued tries
        are dropped, running ones end by their own timeouts."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, set()
        for outcomes in waiting:
            outcomes.put(_CLOSED)
        self._threads.close()

    def call(
        self,
        read: Callable[[Attempt], T],
        *,
        what: str,
        stalled: Callable[[str], StoreError],
    ) -> T:
        """Run ``read(attempt)`` as hedged tries until one returns; see the class docstring.

        ``what`` names the read in messages (``"GET 'a.jpg' bytes 0+100"``); ``stalled(cause)``
        makes the error for a try that timed out here (the store's dataset, key and location).
        """
        one_read = _OneRead(self, read, what=what, stalled=stalled)
        with self._lock:
            if self._closed:
                raise stalled("the store was closed")
            self._waiting.add(one_read.outcomes)
        try:
            if self.inline_first_try:
                answered, result = one_read.run_first_try_here()
                if answered:
                    return cast(T, result)
            return one_read.run()
        finally:
            with self._lock:
                self._waiting.discard(one_read.outcomes)

    def _launch(
        self,
        read: Callable[[Attempt], T],
        attempt: Attempt,
        outcomes: queue.SimpleQueue[_Outcome],
    ) -> None:
        self._now_in_flight()  # before it is queued: a pool thread may end it at once
        try:
            self._threads.submit((read, attempt, outcomes))
        except RuntimeError:  # closed: the store was closed
            self._ended()
            raise

    def _now_in_flight(self) -> None:
        """A try is under way, on a pool thread or on its read's calling thread (counted in
        :attr:`in_flight` until :meth:`_ended`)."""
        with self._lock:
            self._in_flight += 1

    def _ended(self) -> None:
        """A try ended: it ran (:meth:`_run`, or on its read's thread), or :meth:`close` took
        it off the queue before it began (its read was told by :meth:`close` already)."""
        with self._lock:
            self._in_flight -= 1

    def _run(
        self,
        read: Callable[[Attempt], T],
        attempt: Attempt,
        outcomes: queue.SimpleQueue[_Outcome],
    ) -> None:
        """One try, on a pool thread: its outcome goes to ``outcomes``."""
        try:
            attempt.began_at = time.monotonic()
            try:
                attempt.check_abandoned()  # given up while it waited for this thread
                result = read(attempt)
            except AttemptAbandoned:
                return
            except BaseException as exc:  # handed to the caller, which decides
                outcomes.put(_Outcome(attempt, error=exc))
            else:
                outcomes.put(_Outcome(attempt, result=result))
        finally:
            self._ended()


class _OneRead(Generic[T]):
    """The state of one :meth:`HedgedReads.call`: its tries, timers and last failure. Only
    the calling thread runs it; the tries report their outcomes through ``outcomes``."""

    def __init__(
        self,
        reads: HedgedReads,
        read: Callable[[Attempt], T],
        *,
        what: str,
        stalled: Callable[[str], StoreError],
    ):
        self.reads, self.policy = reads, reads.policy
        self.read, self.what, self.stalled = read, what, stalled
        self.outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self.started = time.monotonic()
        self.deadline = self.started + self.policy.deadline_s
        self.live: list[Attempt] = []  # tries not ended and not abandoned, oldest first
        self.tries = 0
        self.failures = 0  # transient failures so far: the backoff's exponent
        self.last_error: StoreError | None = None
        self.launch_at: float | None = self.started  # when the next try is due; None: no plan

    def run_first_try_here(self) -> tuple[bool, T | None]:
        """The first try, on this (the calling) thread, its wait for the answer's headers
        bounded by ``hedge_after_s``: ``(True, result)`` if it succeeded. Else its failure is
        dealt with as any try's (:meth:`_failed`: a permanent one raised, a transient one
        retried after the backoff), and ``(False, None)``: :meth:`run` goes on from there."""
        self.tries = 1
        self.launch_at = None
        attempt = Attempt(1, head_timeout_s=self.policy.hedge_after_s)
        attempt.began_at = time.monotonic()
        self.live.append(attempt)
        self.reads._now_in_flight()
        try:
            result = self.read(attempt)
        except BaseException as exc:
            self._failed(attempt, exc)
            return False, None
        finally:
            self.reads._ended()
        return True, result

    def run(self) -> T:
        try:
            while True:
                now = time.monotonic()
                self._launch_if_due(now)
                self._abandon_stalled(now)
                self._hedge_if_slow(now)
                if now >= self.deadline or (not self.live and not self._launch_in_budget()):
                    raise self._gave_up(now)
                outcome = self._next_outcome(now)
                if outcome is _CLOSED:
                    raise self.stalled("the store was closed")
                if outcome is None or outcome.attempt not in self.live:
                    continue  # a timer is due, or a try already abandoned ended: dropped
                if outcome.error is None:
                    result: T = outcome.result  # the winning try's read(attempt)
                    return result
                self._failed(outcome.attempt, outcome.error)
        finally:
            for attempt in self.live:
                attempt.abandon()

    def _launch_if_due(self, now: float) -> None:
        if self.launch_at is not None and now >= self.launch_at:
            self.launch_at = None
            self.tries += 1
            attempt = Attempt(self.tries)
            try:
                self.reads._launch(self.read, attempt, self.outcomes)
            except RuntimeError:  # its threads are closed: a read racing the dataset's removal
                raise self.stalled("the store was closed") from None
            self.live.append(attempt)

    def _abandon_stalled(self, now: float) -> None:
        timeout_s = self.policy.attempt_timeout_s
        for attempt in [a for a in self.live if a.silent_for(now) >= timeout_s]:
            attempt.abandon()
            self.live.remove(attempt)
            self.last_error = self.stalled(f"the store did not answer within {timeout_s:g} s")
            log.info("%s: try %d got no answer in %g s", self.what, attempt.number, timeout_s)
            if not self.live and self.tries < self.policy.attempts:
                self.launch_at = now  # a stall is not overload: replace it at once

    def _may_hedge(self) -> bool:
        return self.launch_at is None and self.tries < self.policy.attempts and len(self.live) == 1

    def _hedge_if_slow(self, now: float) -> None:
        if self._may_hedge() and self.live[0].silent_for(now) >= self.policy.hedge_after_s:
            log.debug("%s: try %d is slow, hedging", self.what, self.live[0].number)
            self.launch_at = now

    def _launch_in_budget(self) -> bool:
        return self.launch_at is not None and self.launch_at <= self.deadline

    def _next_outcome(self, now: float) -> _Outcome | None:
        """The next outcome of a try, or None once the earliest timer is due: the deadline, a
        planned try, a hedge, a first-byte timeout, or a look at a try not begun yet."""
        policy = self.policy
        wake_at = self.deadline if self.launch_at is None else min(self.deadline, self.launch_at)
        may_hedge = self._may_hedge()
        for attempt in self.live:
            began_at = attempt.began_at
            if attempt.answered:
                continue  # no clock runs for it
            if began_at is None:
                wake_at = min(wake_at, now + _NOT_BEGUN_POLL_S)
                continue
            wake_at = min(wake_at, began_at + policy.attempt_timeout_s)
            if may_hedge:
                wake_at = min(wake_at, began_at + policy.hedge_after_s)
        try:
            return self.outcomes.get(timeout=max(0.0, wake_at - now))
        except queue.Empty:
            return None

    def _failed(self, attempt: Attempt, error: BaseException) -> None:
        self.live.remove(attempt)
        if not (isinstance(error, StoreError) and error.transient):
            raise error
        self.last_error, self.failures = error, self.failures + 1
        if isinstance(error, StoreThrottled):
            self.reads._throttled()
        if not self.live and self.tries < self.policy.attempts:
            delay = backoff_s(self.policy, self.failures, self.reads._jitter)
            log.info(
                "%s failed (try %d of %d), retrying in %.2f s: %s",
                self.what,
                attempt.number,
                self.policy.attempts,
                delay,
                error,
            )
            self.launch_at = time.monotonic() + delay

    def _gave_up(self, now: float) -> StoreError:
        last_error = self.last_error
        if last_error is None:  # tries still running (slowly) when the budget ran out
            last_error = self.stalled(f"no complete answer within {self.policy.deadline_s:g} s")
        error = _gave_up(last_error, what=self.what, tries=self.tries, elapsed=now - self.started)
        if isinstance(last_error, ShortBody):
            # The store answers, but never with all the bytes it promised.
            error = StoreIOError(
                error.cause, dataset=error.dataset, key=error.key, store=error.store
            )
        error.__cause__ = last_error
        return error


class RetriedStore:
    """What the store clients built on these retries share (S3Store, S3BulkReader, OSSStore):
    calls retried, ranged reads hedged and length-checked, errors in the store's words.

    A subclass sets ``description``, ``_dataset``, ``_retry`` and ``_reads`` (a
    :class:`HedgedReads`) and defines :meth:`_attempt`: one try of an SDK call, whatever the SDK
    raises translated into a StoreError."""

    description: str
    _dataset: str
    _retry: RetryPolicy
    _reads: HedgedReads

    def _attempt(self, key: str, call: Callable[[], T]) -> T:
        raise NotImplementedError

    def _call(self, what: str, key: str, call: Callable[[], T]) -> T:
        return call_with_retries(lambda: self._attempt(key, call), self._retry, what=what)

    def _error(self, kind: type[StoreError], cause: str, key: str) -> StoreError:
        return kind(cause, dataset=self._dataset, key=key, store=self.description)

    def _check_listing_order(self, previous_key: str | None, key: str) -> None:
        """Listings must come in strictly ascending UTF-8 byte order (code-point order of str),
        as S3 and OSS promise; the snapshot build relies on it."""
        if previous_key is not None and key <= previous_key:
            raise self._error(
                StoreIOError,
                f"the store listed keys out of order ({key!r} after {previous_key!r})",
                key,
            )

    def _hedged_read(
        self, key: str, offset: int, length: int, one_try: Callable[[Attempt], bytes]
    ) -> bytes:
        """Exactly ``length`` bytes of ``key`` at ``offset``, from tries of ``one_try`` (hedged,
        replaced when they stall, retried under the dataset's policy)."""

        def get_once(attempt: Attempt) -> bytes:
            body = self._attempt(key, lambda: one_try(attempt))
            return check_body_length(
                body, length, key=key, store=self.description, dataset=self._dataset
            )

        return self._reads.call(
            get_once,
            what=f"GET {key!r} bytes {offset}+{length}",
            stalled=lambda cause: self._error(StoreUnavailable, cause, key),
        )

    @property
    def throttled_tries(self) -> int:
        """Tries of reads the store answered "slow down" so far (the adaptive limits' signal)."""
        return self._reads.throttled_tries

    @property
    def tries_in_flight(self) -> int:
        """Tries of reads not ended yet, abandoned ones included (they end by their timeouts)."""
        return self._reads.in_flight


def check_body_length(body: bytes, expected: int, *, key: str, store: str, dataset: str) -> bytes:
    """Return ``body`` if it is exactly ``expected`` bytes long, else raise
    :func:`body_length_error`."""
    if len(body) == expected:
        return body
    raise body_length_error(len(body), expected, key=key, store=store, dataset=dataset)


def body_length_error(
    received: int, expected: int, *, key: str, store: str, dataset: str
) -> StoreError:
    """The error for a body of ``received`` bytes where ``expected`` were asked for.

    Short: :class:`ShortBody` (retried). Long: :class:`StoreIOError` at once — the store sent
    more than the range asked for (it ignored the Range header), and guessing which part is
    ours could serve wrong bytes.
    """
    if received < expected:
        return ShortBody(
            f"the store sent {received} of the {expected} bytes asked for (body cut short)",
            dataset=dataset,
            key=key,
            store=store,
        )
    return StoreIOError(
        f"the store sent {received} bytes where {expected} were asked for "
        "(did it ignore the Range header?)",
        dataset=dataset,
        key=key,
        store=store,
    )


def network_failure_cause(exc: BaseException) -> str:
    """A short, secret-free cause for a network failure, for StoreUnavailable messages: "the
    store did not answer in time (ReadTimeoutError)" for a connect or read timeout, else "the
    store is unreachable: " and the OS error ("Connection refused") if there is one in the
    exception chain, else the exception's class name. Never the exceptions' own text, which may
    quote URLs with signatures in them."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.strerror:  # (not set on a socket timeout)
            return f"the store is unreachable: {link.strerror} ({type(exc).__name__})"
    for link in _chain(exc):
        # Builtin TimeoutError is socket.timeout; botocore's and requests' timeouts wrap (or
        # subclass) urllib3's, whose NewConnectionError is, oddly, a ConnectTimeoutError.
        if isinstance(link, TimeoutError | urllib3.exceptions.TimeoutError) and not isinstance(
            link, urllib3.exceptions.NewConnectionError
        ):
            return f"the store did not answer in time ({type(link).__name__})"
    return f"the store is unreachable: {type(exc).__name__}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it wraps, outermost first."""
    link: BaseException | None = exc
    for _ in range(10):  # the chains are a few links long; bound the walk anyway
        if link is None:
            return
        yield link
        # botocore keeps the underlying exception in .kwargs["error"], not in __cause__.
        wrapped = getattr(link, "kwargs", {}).get("error")
        link = wrapped if isinstance(wrapped, BaseException) else link.__cause__ or link.__context__


def _gave_up(err: StoreError, *, what: str, tries: int, elapsed: float) -> StoreError:
    plural = "try" if tries == 1 else "tries"
    cause = f"{err.cause} (gave up on {what} after {tries} {plural} in {elapsed:.1f} s)"
    return type(err)(cause, dataset=err.dataset, key=err.key, store=err.store)
