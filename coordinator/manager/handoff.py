"""Fills and scaling: a copy gains or loses nodes, and the hand-off invariant.

A scale changes a copy's node set; rendezvous hashing moves only the shards whose owner changed,
and the new owners copy those from the previous owners (a fill, like a clone's) before the old
nodes drop what they no longer own. A fill is named by (dataset, copy, id) in the view, in the
workers' reports and here; it ends when every live node of the copy reported it done (or it
timed out).

**The hand-off invariant: a node drops a shard it handed off only once another node holds it.**
When a fill ends, for every node that held data of the copy before (its previous nodes, the
nodes leaving it, and nodes still waiting from an earlier hand-off), :meth:`Fills._settle`
compares heartbeats: a shard the node holds and no longer owns is trimmed (a ``trim`` task
naming the shards) only if the shard's owner in the copy now reports at least as many bytes of
it (:func:`~coordinator.copies.split_handed_off`) and no block of it failed to copy in a fill
(``copy.failed_in_fill``, :meth:`Fills._note_failed_shards`); the others wait in the copy's
``handed_off`` and are judged again on every tick. A scale folds the trims still pending for
the copy back into ``handed_off``, so a trim decided before a scale is never carried out after
it; a worker also never trims a shard it owns under its current view
(:mod:`cachefs.cluster.tasks`).
"""

from __future__ import annotations

from cachefs.protocol import SHARDS, shard_owner

from ..copies import CopyState, FillState, split_handed_off
from ..errors import CopyBusy, CopyNotFound, NodeNotFound, StateConflict
from ..json_types import JsonDoc
from ..model import ClusterModel
from .journal import Journal

#: A fill as its reports name it: (dataset, copy, fill id).
FillKey = tuple[str, str, str]


class Fills:
    """Copies being filled from peers, scaling, and the hand-off invariant (call under the
    model's lock)."""

    def __init__(self, model: ClusterModel, journal: Journal, *, fill_timeout_s: float) -> None:
        self.model = model
        self.journal = journal
        self.fill_timeout_s = fill_timeout_s
        #: Soft state, rebuilt from heartbeats: node -> {(dataset, copy, fill id): its latest
        #: report}. A fill's reports are dropped when it ends and a dataset's when it is removed
        #: (a re-added dataset numbers its fills from 1 again).
        self.reports: dict[str, dict[FillKey, JsonDoc]] = {}

    # --- scaling -------------------------------------------------------------------------------

    def scale(self, dataset: str, copy_id: str, add: list[str], remove: list[str]) -> int | None:
        """Add and remove nodes of a copy. The shards whose owner changes are handed off: the
        new owners copy them from the old ones (who keep serving them meanwhile), then the old
        owners drop what they no longer own. Returns how many shards change owner, or None
        when the copy's nodes stay as they are."""
        with self.model.lock:
            model = self.model
            state = model.dataset(dataset)
            copy = state.copies.get(copy_id)
            if copy is None:
                raise CopyNotFound(f"dataset {dataset!r} has no copy {copy_id!r}")
            if copy.fill is not None:
                raise CopyBusy(
                    f"copy {copy_id} of {dataset} is still being filled ({copy.fill.reason}, "
                    f"fill {copy.fill.id}); scale it again once that is done"
                )
            unknown = sorted(set(add) - set(model.nodes))
            if unknown:
                raise NodeNotFound(f"no node named {', '.join(map(repr, unknown))}")
            current = model.copy_nodes(dataset, copy_id)
            elsewhere = {
                node
                for other in state.copies
                if other != copy_id
                for node in model.copy_nodes(dataset, other)
            }
            clash = sorted(set(add) & elsewhere)
            if clash:
                raise StateConflict(
                    f"{', '.join(clash)} already belong to another copy of {dataset}"
                )
            absent = sorted(set(remove) - set(current))
            if absent:
                raise StateConflict(f"{', '.join(absent)} are not in copy {copy_id} of {dataset}")
            new = sorted((set(current) | set(add)) - set(remove))
            if not new:
                raise StateConflict(f"copy {copy_id} of {dataset} needs at least one node")
            if new == current:
                return None
            now = model.now()
            live_before = model.live_copy_nodes(dataset, copy_id)
            copy.nodes = new
            live_after = model.live_copy_nodes(dataset, copy_id)
            moved = sum(
                shard_owner(dataset, shard, live_before) != shard_owner(dataset, shard, live_after)
                for shard in range(SHARDS)
            )
            added, removed = sorted(set(new) - set(current)), sorted(set(current) - set(new))
            copy.fill = FillState(
                id=state.next_fill_id(copy_id),
                sources=current,
                leaving=removed,
                reason=f"scale: +{','.join(added) or '-'} -{','.join(removed) or '-'}",
                started_at=now,
            )
            self._fold_pending_trims(dataset, copy_id, copy)
            model.save_dataset(state)
            self.journal.cancel_tasks(dataset, added)
            self.journal.event(
                "scale", dataset, copy_id,
                f"copy {copy_id} of {dataset} scaled to {', '.join(new)} "
                f"(added {', '.join(added) or 'none'}, removed {', '.join(removed) or 'none'}): "
                f"{moved} of {SHARDS} shards change owner and are handed off",
                added=added, removed=removed, moved_shards=moved,
            )  # fmt: skip
            return moved

    def _fold_pending_trims(self, dataset: str, copy_id: str, copy: CopyState) -> None:
        """A scale starts: trims of the copy not yet acknowledged were decided under the old
        membership. They go back to ``handed_off``, judged again when this scale's fill ends
        (a worker may still be running one: it never drops a shard it owns then)."""
        for task in self.journal.pending_trims(dataset, copy_id):
            waiting = set(copy.handed_off.get(task.node, ())) | set(task.shards or ())
            copy.handed_off[task.node] = sorted(waiting)
            self.journal.drop_task(task)

    # --- reports and views ---------------------------------------------------------------------

    def record(self, node: str, fills: dict[str, JsonDoc]) -> None:
        """A heartbeat's fill reports (dataset -> report). Only a copy's current fill counts: a
        heartbeat sent before the node saw a fill end still reports it, and keeping that report
        would leak it (:meth:`_finish` dropped the fill's reports already)."""
        for dataset, fill in fills.items():
            copy_id, fill_id = fill.get("copy"), fill.get("id")
            if (
                isinstance(copy_id, str)
                and isinstance(fill_id, str)
                and self._is_current(dataset, copy_id, fill_id)
            ):
                self.reports.setdefault(node, {})[(dataset, copy_id, fill_id)] = fill

    def _is_current(self, dataset: str, copy_id: str, fill_id: str) -> bool:
        state = self.model.datasets.get(dataset)
        copy = state.copies.get(copy_id) if state is not None else None
        return copy is not None and copy.fill is not None and copy.fill.id == fill_id

    def _report(self, node: str, dataset: str, copy_id: str, fill_id: str) -> JsonDoc | None:
        """``node``'s latest report of the fill (dataset, copy, id), or None."""
        return self.reports.get(node, {}).get((dataset, copy_id, fill_id))

    def view(self, dataset: str) -> JsonDoc:
        """The dataset's fills as heartbeat replies carry them: copy -> id and live sources."""
        return {
            copy_id: {
                "id": copy.fill.id,
                "from": sorted(n for n in copy.fill.sources if self.model.node_is_up(n)),
            }
            for copy_id, copy in self.model.dataset(dataset).copies.items()
            if copy.fill is not None
        }

    def progress(self, dataset: str, copy_id: str, fill: FillState) -> JsonDoc:
        """A running fill as ``GET /v1/datasets/{name}`` shows it: bytes copied, nodes done."""
        reports = [
            self._report(node, dataset, copy_id, fill.id)
            for node in self.model.live_copy_nodes(dataset, copy_id)
        ]
        done = [r for r in reports if r]
        return {
            **fill.to_json(),
            "copied_bytes": sum(r.get("copied_bytes", 0) for r in done),
            "nodes_done": sum(1 for r in done if r.get("done")),
        }

    def forget_dataset(self, dataset: str) -> None:
        for node_reports in self.reports.values():
            for key in [key for key in node_reports if key[0] == dataset]:
                del node_reports[key]

    # --- the periodic work ---------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self._drop_reports_of_nodes_gone(now)
        self._finish(now)
        self._settle_waiting()

    def _drop_reports_of_nodes_gone(self, now: float) -> None:
        """A node that left (no longer registered, or down) counts for no fill: its reports go;
        back up, it reports again in its next heartbeat."""
        for node in list(self.reports):
            if not self.model.node_is_up(node, now):
                del self.reports[node]

    def _finish(self, now: float) -> None:
        for name, state in self.model.datasets.items():
            for copy_id, copy in state.copies.items():
                fill = copy.fill
                if fill is None:
                    continue
                live = self.model.live_copy_nodes(name, copy_id)
                reports = [self._report(node, name, copy_id, fill.id) for node in live]
                done = all(r and r.get("done") for r in reports)
                timed_out = now - fill.started_at > self.fill_timeout_s
                if not (done or timed_out):
                    continue
                copied = sum(r.get("copied_bytes", 0) for r in reports if r)
                absent = sum(r.get("absent_blocks", 0) for r in reports if r)
                failed = sum(r.get("failed_blocks", 0) for r in reports if r)
                copy.fill = None
                for node in list(self.reports):
                    self.reports[node].pop((name, copy_id, fill.id), None)
                    if not self.reports[node]:
                        del self.reports[node]
                outcome = "timed out" if not done else "done"
                message = (
                    f"fill {fill.id} of copy {copy_id} ({fill.reason}) {outcome}: {copied} bytes "
                    f"copied from peers, {absent} blocks the sources did not hold, {failed} failed"
                )
                details = {"copied_bytes": copied, "absent_blocks": absent, "failed_blocks": failed}
                if fill.hands_off:
                    # The invariant (module docstring): the nodes that held the copy's data drop
                    # only the shards their new owner holds; the rest wait in ``handed_off``.
                    self._note_failed_shards(
                        name, copy_id, copy, fill, dict(zip(live, reports, strict=True))
                    )
                    holders = set(fill.sources) | set(fill.leaving) | set(copy.handed_off)
                    trimmed, kept = self._settle(
                        name, copy_id, copy, holders, None, f"hand-off {fill.id} finished"
                    )
                    message += f"; {trimmed} shards dropped by the nodes that handed them off"
                    if kept:
                        message += f", {kept} kept until their new owner holds them"
                    details.update(trimmed_shards=trimmed, kept_shards=kept)
                self.model.save_dataset(state)
                self.journal.event("fill", name, copy_id, message, **details)

    def _note_failed_shards(
        self,
        dataset: str,
        copy_id: str,
        copy: CopyState,
        fill: FillState,
        reports: dict[str, JsonDoc | None],
    ) -> None:
        """A hand-off's fill ended: record in ``copy.failed_in_fill`` the shards whose new owner
        failed to copy blocks (their holders keep them whatever the bytes say), and take out the
        shards recorded by an earlier fill that this one walked without a failure. Only a node
        that reported done walked its shards, and only one with no absent blocks proves them
        whole: this fill's source for a shard is its previous owner, which may lack blocks the
        earlier holder still has."""
        failed: set[int] = set()
        for report in reports.values():
            for shard, count in ((report or {}).get("failed_shards") or {}).items():
                if count > 0:
                    failed.add(int(shard))
        recorded = set(copy.failed_in_fill)
        if recorded:
            live = self.model.live_copy_nodes(dataset, copy_id)
            sources = [n for n in fill.sources if self.model.node_is_up(n)]
            for shard in sorted(recorded):
                owner = shard_owner(dataset, shard, live)
                source = shard_owner(dataset, shard, sources)
                report = reports.get(owner) if owner is not None else None
                if report is None or source in (None, owner) or not report.get("done"):
                    continue  # not walked by this fill
                if not report.get("absent_blocks", 0) and shard not in failed:
                    recorded.discard(shard)
        copy.failed_in_fill = sorted(recorded | failed)

    def _owned_among(self, dataset: str, node: str, shards: set[int]) -> set[int]:
        """Those of ``shards`` that ``node`` owns in its own copy of ``dataset`` now (none when
        it is in no copy, or down)."""
        for copy_id in self.model.datasets[dataset].copies:
            if node in self.model.copy_nodes(dataset, copy_id):
                live = self.model.live_copy_nodes(dataset, copy_id)
                return {shard for shard in shards if shard_owner(dataset, shard, live) == node}
        return set()

    def _settle(
        self,
        dataset: str,
        copy_id: str,
        copy: CopyState,
        nodes: set[str],
        only: dict[str, list[int]] | None,
        reason: str,
    ) -> tuple[int, int]:
        """Apply the hand-off invariant to ``nodes`` (every shard they hold, or ``only`` those
        listed per node): a ``trim`` task for the shards whose owner in the copy holds them, the
        others recorded in ``copy.handed_off``. Returns (shards trimmed, shards kept). The
        caller saves the dataset."""
        live = self.model.live_copy_nodes(dataset, copy_id)
        trimmed = kept = 0
        for node in sorted(nodes):
            held = self.model.shard_bytes(node, dataset)
            if only is not None:
                listed = set(only.get(node, ()))
                held = {shard: nbytes for shard, nbytes in held.items() if shard in listed}
            owners = {shard: shard_owner(dataset, shard, live) for shard in held}
            owner_holds = {
                owner: self.model.shard_bytes(owner, dataset)
                for owner in set(owners.values())
                if owner is not None
            }
            owned = self._owned_among(dataset, node, set(held))
            trim, wait = split_handed_off(
                node, held, owned, owners, owner_holds, set(copy.failed_in_fill)
            )
            if trim:
                self.journal.add_task(
                    node, "trim", dataset, reason, copy=copy_id, shards=sorted(trim)
                )
            if wait:
                copy.handed_off[node] = sorted(wait)
            else:
                copy.handed_off.pop(node, None)
            trimmed, kept = trimmed + len(trim), kept + len(wait)
        # A shard no node holds back any more needs no confirming: nothing can be lost.
        held_back = {shard for shards in copy.handed_off.values() for shard in shards}
        copy.failed_in_fill = [s for s in copy.failed_in_fill if s in held_back]
        return trimmed, kept

    def _settle_waiting(self) -> None:
        """Judge again the shards kept after a hand-off (their owner may hold them now: read
        through, preloaded). Not while the copy is filling: that fill's end judges them."""
        for name, state in self.model.datasets.items():
            for copy_id, copy in state.copies.items():
                if copy.fill is not None or not copy.handed_off:
                    continue
                before = dict(copy.handed_off)
                waiting = set(before)
                trimmed, _ = self._settle(
                    name, copy_id, copy, waiting, before, "shards handed off earlier: "
                    f"their owner in copy {copy_id} holds them now",
                )  # fmt: skip
                if copy.handed_off != before:
                    self.model.save_dataset(state)
                if trimmed:
                    self.journal.event(
                        "trim", name, copy_id,
                        f"{trimmed} shards of copy {copy_id} handed off earlier are dropped by "
                        f"{', '.join(sorted(waiting))}: their owner holds them now",
                        trimmed_shards=trimmed,
                    )  # fmt: skip
