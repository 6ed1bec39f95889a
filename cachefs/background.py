"""A nursery for background tasks that an object starts from plain (synchronous) methods.

Several parts of the worker start tasks from methods that are not async (a heartbeat's
assignments start fills and preload jobs, a read starts read-ahead fetches, a first request to a
peer starts that connection's receiver). Structured concurrency wants those tasks in a nursery
that something awaits: the part's ``run`` opens one and serves until cancelled, and the tasks
live and die with it. :class:`BackgroundTasks` is that pattern written once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


class BackgroundTasks:
    """Where an object's background tasks run: open while :meth:`run` runs (its owner starts
    it in a nursery: ``await nursery.start(tasks.run)``), closed before and after."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Start ``task(*args)`` here; False (and nothing started) when not running."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(task, *args)
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery open until cancelled; its tasks are cancelled with it."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
