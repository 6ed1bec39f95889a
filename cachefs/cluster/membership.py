"""The worker's view of the cluster: which node owns each shard of each dataset.

Built from the membership in the coordinator's heartbeat reply (the live nodes of each copy)
with the same rendezvous function the coordinator uses, so both agree without ever storing an
owner table. Lookups are on the FUSE hot path: one dict lookup and one list index.

A node reads through its own copy — the first copy of the dataset that lists it — or, if it is
in none, through the first copy. With no view yet (coordinator never reached) a node owns
everything: it behaves like a single-node worker until it learns otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachefs.protocol import owner_table


@dataclass(frozen=True)
class DatasetOwners:
    copy: str
    nodes: tuple[str, ...]  # live nodes of the copy, sorted
    owners: list[str | None]  # shard -> node


class Membership:
    def __init__(self, node: str):
        self.node = node
        self.addresses: dict[str, str] = {}
        self._datasets: dict[str, DatasetOwners] = {}

    def update(self, view: dict) -> bool:
        """Take a heartbeat reply's membership. Returns True if any shard changed owner."""
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
            current = self._datasets.get(name)
            if current is not None and current.copy == copy and current.nodes == nodes:
                fresh[name] = current
                continue
            fresh[name] = DatasetOwners(copy, nodes, owner_table(name, nodes))
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

    def owned_shards(self, dataset: str, copy: str, live_nodes: list[str]) -> set[int]:
        """Shards of ``dataset`` this node owns among ``live_nodes`` of ``copy`` (for a
        preload job, which names its copy)."""
        owners = self._datasets.get(dataset)
        if owners is not None and owners.copy == copy:
            table = owners.owners
        else:
            table = owner_table(dataset, tuple(sorted(live_nodes)))
        return {shard for shard, owner in enumerate(table) if owner == self.node}
