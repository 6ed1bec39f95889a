"""What a task serving one peer connection of the native READ path does between its calls into
C: wait for the owner's answers within the peer timeout; run the READs C handed back as tasks.

The worker (cachefs/fs/native_peer_reads.py) and a serving process
(cachefs/fs/serving_process.py) each serve their connections so. It imports trio alone, so
that a serving process may use it (the serving process's import contract in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any

import trio

#: A READ that C handed back: its Python handler, not started.
HandedBack = Coroutine[Any, Any, None]


async def wait_for_answers(fd: int, pending: int, oldest_age_s: float, timeout_s: float) -> bool:
    """Wait until the connection ``fd`` has bytes to read, at most a quarter of ``timeout_s``
    (so that a peer cooled down elsewhere is seen soon after) and no longer than the oldest of
    its ``pending`` READs has left. False, at once, when that READ has waited ``timeout_s``."""
    if pending and oldest_age_s >= timeout_s:
        return False
    tick = timeout_s / 4
    with trio.move_on_after(min(tick, timeout_s - oldest_age_s) if pending else tick):
        await trio.lowlevel.wait_readable(fd)
    return True


def run_handed_back(nursery: trio.Nursery | None, handed_back: Iterable[HandedBack]) -> None:
    """Start each READ that C handed back in ``nursery``. With no nursery, or one being
    cancelled (ending), close it unanswered instead, like any READ in flight at the end.

    The calling task's own cancellation says nothing here: a serving process cancels a link's
    task when the worker closes that link, while the process goes on serving, and the READs
    that the link's last receive handed back must still be answered."""
    ending = nursery is None or nursery.cancel_scope.cancel_called
    for coroutine in handed_back:
        if ending:
            coroutine.close()
        else:
            assert nursery is not None
            nursery.start_soon(_await, coroutine)


async def _await(coroutine: HandedBack) -> None:
    await coroutine
