"""Waiting for a dataset to be served here: what the preloader and the filler do when the
coordinator's view names work for a dataset this worker has not opened yet.

The same heartbeat reply can carry a new dataset and a preload job (or a fill) for it, and
opening a dataset (listing its source, building its snapshot) takes from milliseconds to
minutes. Work for it waits on :meth:`ServedDatasets.wait_source`, and the heartbeat agent calls
:meth:`ServedDatasets.changed` whenever the set of datasets served here changes; no task polls.
"""

from __future__ import annotations

import logging
from typing import Protocol, TypeVar

import trio

log = logging.getLogger("cachefs.cluster")

Source = TypeVar("Source")
Source_co = TypeVar("Source_co", covariant=True)


class SourceOf(Protocol[Source_co]):
    def preload_source(self, dataset: str) -> Source_co | None: ...


class ServedDatasets:
    """One event, set and renewed at every change of what this worker serves."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    def changed(self) -> None:
        """The datasets served here changed: wake every task waiting for one."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_source(self, target: SourceOf[Source], dataset: str, what: str) -> Source:
        """``target.preload_source(dataset)`` once the dataset is served here (at once if it is
        already). ``what`` names the waiting work in the log line."""
        source = target.preload_source(dataset)
        if source is None:
            log.info("%s: dataset %r not served here yet; it starts once it is", what, dataset)
        while source is None:
            # No checkpoint between the look-up and taking the event: a change cannot slip by.
            await self._changed.wait()
            source = target.preload_source(dataset)
        return source
