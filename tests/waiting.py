"""How long a test waits for background work: one bound for every wait in the suite.

Tests wait on events and states (a condition polled until it holds), never on wall-clock
windows, and never assert timings. The bound is only there so that a broken test ends: it is
generous because CI and developer machines are loaded (two cores running the suite, servers and
worker processes at once; the suite must pass with both cores busy with a CPU hog). A wait
ends as soon as its condition holds, so a generous bound costs nothing when things work.
``CACHEFS_TEST_WAIT_S`` overrides it (e.g. larger on a very slow machine).
"""

from __future__ import annotations

import os
import time

#: The bound of every wait for background work, in seconds.
WAIT_S = float(os.environ.get("CACHEFS_TEST_WAIT_S", "240"))


def wait_for(condition, what: str, timeout: float | None = None, interval: float = 0.05) -> None:
    """Poll ``condition()`` until it is true; exceptions count as "not yet" (the thing waited
    for may not answer yet). Raises AssertionError naming ``what`` after ``timeout`` (default
    :data:`WAIT_S`)."""
    bound = WAIT_S if timeout is None else max(timeout, WAIT_S)
    deadline = time.monotonic() + bound
    last_error: Exception | None = None
    while True:
        try:
            if condition():
                return
            last_error = None
        except Exception as exc:  # reported below if it never stops
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(f"timed out after {bound:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


async def wait_until(condition, what: str = "the condition", timeout: float | None = None) -> None:
    """:func:`wait_for` inside a trio test: polls ``condition()`` with trio sleeps, so the tasks
    it waits for keep running."""
    import trio

    bound = WAIT_S if timeout is None else max(timeout, WAIT_S)
    with trio.move_on_after(bound):
        while not condition():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out after {bound:.0f} s waiting for {what}")
