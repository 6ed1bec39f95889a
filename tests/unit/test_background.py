"""BackgroundTasks (cachefs/background.py): tasks start only while its nursery is open, and
end with it."""

from __future__ import annotations

import trio
import trio.testing

from cachefs.background import BackgroundTasks


async def test_tasks_start_only_while_it_runs_and_end_with_it() -> None:
    tasks = BackgroundTasks()
    started: list[str] = []
    cancelled: list[str] = []

    async def task(name: str) -> None:
        started.append(name)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(name)
            raise

    assert not tasks.running and not tasks.start_soon(task, "before")
    async with trio.open_nursery() as nursery:
        await nursery.start(tasks.run)
        assert tasks.running and tasks.start_soon(task, "during")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert started == ["during"] and cancelled == ["during"]
    assert not tasks.running and not tasks.start_soon(task, "after")
