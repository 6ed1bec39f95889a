"""Cleanup per dataset, decided here and carried out by workers as ``free`` tasks.

``lock`` never frees; ``ttl:<d>`` frees a copy no job used and no node read for ``d`` (a clone
is removed, the last copy kept empty); ``lru`` frees, on a node whose cache is nearly full, the
least recently used such dataset. Workers never touch their reserve.

Last use of a copy = the latest of its creation, a job placed on or released from it, the end of
a preload of it, and the ``last_read_at`` its nodes report per dataset.
"""

from __future__ import annotations

from cachefs.protocol import CleanupPolicy

from ..json_types import JsonDoc
from ..model import ClusterModel
from .jobs import Jobs
from .journal import Journal


class Cleanup:
    """The ttl and lru policies (call under the model's lock)."""

    def __init__(
        self, model: ClusterModel, journal: Journal, jobs: Jobs, *, lru_high_watermark: float
    ) -> None:
        self.model = model
        self.journal = journal
        self.jobs = jobs
        self.lru_high_watermark = lru_high_watermark
        self._lru_freed: dict[tuple[str, str], float] = {}  # (node, dataset) -> when (soft)

    def tick(self, now: float) -> None:
        self._ttl(now)
        self._lru(now)

    def _last_read(self, dataset: str, nodes: list[str]) -> float:
        return max(
            (
                self.model.nodes[n].datasets.get(dataset, {}).get("last_read_at", 0.0)
                for n in nodes
                if n in self.model.nodes
            ),
            default=0.0,
        )

    def _last_preload(self, dataset: str, copy_id: str) -> float:
        """When a preload of the copy last ended: freshly preloaded data counts as used."""
        return max(
            (
                p.finished_at or p.created_at
                for p in self.model.preloads.values()
                if p.dataset == dataset and p.copy == copy_id
            ),
            default=0.0,
        )

    def _copy_busy(self, dataset: str, copy_id: str) -> bool:
        """A job runs on it, or a preload fills it."""
        if self.jobs.on_copy(dataset, copy_id):
            return True
        return any(
            p.dataset == dataset and p.copy == copy_id and p.state in ("running", "scheduled")
            for p in self.model.preloads.values()
        )

    def _ttl(self, now: float) -> None:
        for name, state in list(self.model.datasets.items()):
            ttl_s = CleanupPolicy.parse(state.spec.cleanup).ttl_s
            if ttl_s is None:  # lock or lru
                continue
            for copy_id in reversed(list(state.copies)):  # newest first: clones go first
                copy = state.copies[copy_id]
                if copy.fill is not None or self._copy_busy(name, copy_id):
                    continue
                nodes = self.model.copy_nodes(name, copy_id)
                last_used = max(
                    copy.created_at,
                    copy.last_used_at,
                    self._last_read(name, nodes),
                    self._last_preload(name, copy_id),
                )
                if copy.freed_at is not None and copy.freed_at >= last_used:
                    continue  # freed, and nobody used it since
                idle = now - last_used
                if idle < ttl_s:
                    continue
                reason = f"ttl: copy {copy_id} idle for {idle:.0f} s (ttl {ttl_s:g} s)"
                for node in nodes:
                    self.journal.add_task(node, "free", name, reason)
                if len(state.copies) > 1:
                    del state.copies[copy_id]
                    what = "freed and removed"
                else:
                    copy.freed_at = now
                    what = "freed (kept as the dataset's only copy)"
                self.model.save_dataset(state)
                self.journal.event(
                    "cleanup", name, copy_id, f"copy {copy_id} of {name} {what}: {reason}"
                )

    def _lru(self, now: float) -> None:
        """On each node whose cache is at least ``lru_high_watermark`` full, free the least
        recently used ``lru`` dataset — one at a time, re-judged on the next heartbeat."""
        busy_nodes = self.journal.nodes_with_tasks()
        in_use = self.jobs.datasets_in_use()
        datasets = self.model.datasets
        for name, node in self.model.nodes.items():
            if name in busy_nodes or not self.model.is_up(node, now):
                continue
            capacity, used = node.cache_capacity, node.cache_used
            if not capacity or used / capacity < self.lru_high_watermark:
                continue
            held = {
                dataset: report
                for dataset, report in node.datasets.items()
                if dataset in datasets and report.get("cached_bytes", 0) > 0
            }
            if len(held) < 2:
                continue  # freeing the one dataset being read would only make it thrash

            def last_used(dataset: str, held: dict[str, JsonDoc] = held) -> float:
                return max(
                    float(held[dataset].get("last_read_at", 0.0)),
                    datasets[dataset].spec.created_at,
                )

            newest = max(held, key=last_used)
            candidates = [
                dataset
                for dataset in held
                if dataset != newest
                and dataset not in in_use
                and CleanupPolicy.parse(datasets[dataset].spec.cleanup).kind == "lru"
                and self._lru_freed.get((name, dataset), -1.0) < last_used(dataset)
            ]
            if not candidates:
                continue
            victim = min(candidates, key=last_used)
            self._lru_freed[(name, victim)] = now
            reason = (
                f"lru: {name}'s cache is {used / capacity:.0%} full; {victim} is its least "
                f"recently used dataset (last read {now - last_used(victim):.0f} s ago)"
            )
            self.journal.add_task(name, "free", victim, reason)
            self.journal.event(
                "cleanup", victim, None, f"{victim} freed on {name}: {reason}", node=name
            )
