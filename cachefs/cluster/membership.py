"""The worker's view of the cluster: which node owns each shard of each dataset.

Built from the membership in the coordinator's heartbeat reply (the live nodes of each copy)
with the same rendezvous function the coordinator uses, so both agree without ever storing an
owner table. Lookups are on the FUSE hot path: one dict lookup and one list index.

A node reads through its own copy — the first copy of the dataset that lists it — or, if it is
in none, through the first copy. With no view yet (coordinator never reached) a node owns
everything: it behaves like a single-node worker until it learns otherwise.

A copy being *filled* (a clone of another copy, or a copy whose node set was scaled) names the
nodes that held the data before (``fills`` in the view). Their owner table says, per shard,
which of them probably holds the block: the *fill source*. An owner asks it first, cached-only,
before reading the store (:meth:`Membership.fill_address`), and the filler copies the owner's
shards from it in the background (:meth:`Membership.fill_assignments`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachefs.protocol import owner_table


@dataclass(frozen=True)
class FillSource:
    id: str  # the coordinator's fill id: a new id is a new fill
    nodes: tuple[str, ...]  # the live nodes that held the data before, sorted
    owners: list[str | None]  # shard -> the node among them that held it


@dataclass(frozen=True)
class DatasetOwners:
    copy: str
    nodes: tuple[str, ...]  # live nodes of the copy, sorted
    owners: list[str | None]  # shard -> node
    fill: FillSource | None = None  # the copy is being filled from these nodes


@dataclass(frozen=True)
class FillAssignment:
    """What this node copies for one fill: the shards it owns in ``copy`` whose fill source
    is another node (their addresses come from :meth:`Membership.fill_address`)."""

    dataset: str
    copy: str
    fill_id: str
    shards: frozenset[int]


class Membership:
    def __init__(self, node: str):
        self.node = node
        self.addresses: dict[str, str] = {}
        self._datasets: dict[str, DatasetOwners] = {}

    def update(self, view: dict[str, Any]) -> bool:
        """Take a heartbeat reply's membership. Returns True if any shard changed owner or
        fill source."""
        self.addresses = {
            name: node["address"] for name, node in view["nodes"].items() if name != self.node
        }
        changed = False
        fresh: dict[str, DatasetOwners] = {}
        for dataset in view["datasets"]:
            name = dataset["spec"]["name"]
            copies: dict[str, list[str]] = dataset["copies"]
            if not copies:
                continue
            copy = next((c for c, nodes in copies.items() if self.node in nodes), None)
            copy = copy or next(iter(copies))
            nodes = tuple(sorted(copies[copy]))
            fill = (dataset.get("fills") or {}).get(copy)
            fill_key = None if fill is None else (fill["id"], tuple(sorted(fill["from"])))
            current = self._datasets.get(name)
            if current is not None and current.copy == copy and current.nodes == nodes:
                had = current.fill
                if fill_key == (None if had is None else (had.id, had.nodes)):
                    fresh[name] = current
                    continue
                owners = current.owners  # only the fill changed: keep the owner table
            else:
                owners = owner_table(name, nodes)
            fill_source = None
            if fill_key is not None:
                fill_id, sources = fill_key
                fill_source = FillSource(fill_id, sources, owner_table(name, sources))
            fresh[name] = DatasetOwners(copy, nodes, owners, fill_source)
            changed = True
        changed |= set(fresh) != set(self._datasets)
        self._datasets = fresh
        return changed

    def owner_address(self, dataset: str, shard: int) -> str | None:
        """The owner's peer address when another node owns the shard; None when this node
        fetches the block itself (it is the owner, there is no live owner, or no view)."""
        owners = self._datasets.get(dataset)
        if owners is None:
            return None
        owner = owners.owners[shard]
        if owner is None or owner == self.node:
            return None
        return self.addresses.get(owner)

    def fill_address(self, dataset: str, shard: int) -> str | None:
        """The peer address of the shard's fill source when this node's copy of ``dataset`` is
        being filled and that source is another node with a known address; None otherwise."""
        owners = self._datasets.get(dataset)
        if owners is None or owners.fill is None:
            return None
        source = owners.fill.owners[shard]
        if source is None or source == self.node:
            return None
        return self.addresses.get(source)

    def fill_assignments(self) -> dict[str, FillAssignment]:
        """Per dataset whose copy (this node's) is being filled: the shards this node owns
        there and should copy from another node. A node in no copy of the dataset owns
        nothing there, so it has nothing to fill."""
        assignments = {}
        for name, owners in self._datasets.items():
            fill = owners.fill
            if fill is None:
                continue
            pairs = enumerate(zip(owners.owners, fill.owners, strict=True))
            shards = frozenset(
                shard
                for shard, (owner, source) in pairs
                if owner == self.node and source is not None and source != self.node
            )
            assignments[name] = FillAssignment(name, owners.copy, fill.id, shards)
        return assignments

    def own_copy_shards(self, dataset: str) -> set[int]:
        """Shards of ``dataset`` this node owns in its own copy under the current view: none
        when it is in no copy of the dataset (or the view does not list the dataset)."""
        owners = self._datasets.get(dataset)
        if owners is None or self.node not in owners.nodes:
            return set()
        return {shard for shard, owner in enumerate(owners.owners) if owner == self.node}

    def owned_shards(self, dataset: str, copy: str, live_nodes: list[str]) -> set[int]:
        """Shards of ``dataset`` this node owns among ``live_nodes`` of ``copy`` (for a
        preload job, which names its copy)."""
        owners = self._datasets.get(dataset)
        if owners is not None and owners.copy == copy:
            table = owners.owners
        else:
            table = owner_table(dataset, tuple(sorted(live_nodes)))
        return {shard for shard, owner in enumerate(table) if owner == self.node}
