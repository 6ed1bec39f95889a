"""The one retry loop of the object-store layer, and the checks that decide what it retries.

SDK-level retries are switched off (boto3) or bypassed (oss2's iterators) so that every store
call is retried exactly here, with one policy (:class:`~cachefs.store.base.RetryPolicy`) and one
place that decides what "transient" means: a :class:`~cachefs.errors.StoreError` whose
``transient`` attribute is true (in practice :class:`~cachefs.errors.StoreUnavailable`).

Everything here is blocking; it runs in worker threads, never on the trio loop.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from cachefs.errors import StoreError, StoreIOError, StoreUnavailable
from cachefs.store.base import RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShortBody(StoreUnavailable):
    """A response body ended before the promised length (connection cut mid-body).

    Transient, so the retry loop tries again; if every try is short,
    :func:`call_ranged_read_with_retries` turns it into a :class:`StoreIOError`.
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
            backoff = min(policy.max_delay_s, policy.base_delay_s * 2 ** (tries - 1))
            delay = jitter() * backoff
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


def call_ranged_read_with_retries(
    fn: Callable[[], bytes], policy: RetryPolicy, *, what: str
) -> bytes:
    """:func:`call_with_retries` for a ranged read: a body that stays short after every try is
    a :class:`StoreIOError` (the store is answering, but not with the bytes it promised)."""
    try:
        return call_with_retries(fn, policy, what=what)
    except ShortBody as err:
        raise StoreIOError(err.cause, dataset=err.dataset, key=err.key, store=err.store) from err


def check_body_length(body: bytes, expected: int, *, key: str, store: str, dataset: str) -> bytes:
    """Return ``body`` if it is exactly ``expected`` bytes long, else raise.

    Short: :class:`ShortBody` (retried). Long: :class:`StoreIOError` at once — the store sent
    more than the range asked for (it ignored the Range header), and guessing which part is
    ours could serve wrong bytes.
    """
    if len(body) == expected:
        return body
    if len(body) < expected:
        raise ShortBody(
            f"the store sent {len(body)} of the {expected} bytes asked for (body cut short)",
            dataset=dataset,
            key=key,
            store=store,
        )
    raise StoreIOError(
        f"the store sent {len(body)} bytes where {expected} were asked for "
        "(did it ignore the Range header?)",
        dataset=dataset,
        key=key,
        store=store,
    )


def network_failure_reason(exc: BaseException) -> str:
    """A short, secret-free reason for a network failure, for StoreUnavailable messages: the OS
    error ("Connection refused") if there is one in the exception chain, else the exception's
    class name ("ReadTimeoutError"). Never the exceptions' own text, which may quote URLs with
    signatures in them."""
    link: BaseException | None = exc
    for _ in range(10):  # the chains are a few links long; bound the walk anyway
        if link is None:
            break
        if isinstance(link, OSError) and link.strerror:
            return f"{link.strerror} ({type(exc).__name__})"
        # botocore keeps the underlying exception in .kwargs["error"], not in __cause__.
        wrapped = getattr(link, "kwargs", {}).get("error")
        link = wrapped if isinstance(wrapped, BaseException) else link.__cause__ or link.__context__
    return type(exc).__name__


def _gave_up(err: StoreError, *, what: str, tries: int, elapsed: float) -> StoreError:
    plural = "try" if tries == 1 else "tries"
    cause = f"{err.cause} (gave up on {what} after {tries} {plural} in {elapsed:.1f} s)"
    return type(err)(cause, dataset=err.dataset, key=err.key, store=err.store)
