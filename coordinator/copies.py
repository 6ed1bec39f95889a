"""Cached copies of a dataset, and TDCS's ranking of nodes for a job (P1's CacheManager).

A copy is a set of nodes that together hold one cached copy of a dataset: within it each shard
has one owner (rendezvous over the copy's live nodes). ``nodes = None`` means "every registered
node" — the default first copy, which grows with the cluster. Clone adds copies on other nodes;
scaling changes a copy's node set. While a copy is being filled (a clone, or the nodes a scale
added) it names the nodes that held the data before, so its owners copy blocks from those
peers instead of the object store. After a scale's fill the nodes that handed shards off drop
them — only those their new owner holds (:func:`split_handed_off`, the hand-off invariant);
the others wait in ``handed_off`` until it does.

The functions at the bottom are pure: given locality numbers they choose and rank; the
:class:`~coordinator.manager.CacheManager` supplies the numbers and records the outcome.
"""

from __future__ import annotations

import string
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field

from .json_types import JsonDoc

DEFAULT_COPY = "A"


@dataclass
class FillState:
    """A copy being filled from peers: a clone from its source copy, or a scaled copy from its
    previous node set (the hand-off)."""

    # Numbered per dataset ("B-3"), so only (dataset, copy, id) names a fill: every dataset
    # scaled once has an "A-1". Workers report against all three, and the coordinator matches
    # all three.
    id: str
    sources: list[str]  # the nodes that held the data; their shard owners serve the blocks
    leaving: list[str]  # nodes the scale removed: freed once the hand-off is done
    reason: str
    started_at: float

    @property
    def hands_off(self) -> bool:
        """A scale's fill (the previous nodes drop what moved), not a clone's (the source copy
        keeps everything)."""
        return not self.reason.startswith("clone")

    def to_json(self) -> JsonDoc:
        return asdict(self)


@dataclass
class CopyState:
    nodes: list[str] | None  # None = every registered node
    created_at: float = 0.0
    origin: str = "dataset add"
    fill: FillState | None = None
    last_used_at: float = 0.0  # last job placed on or released from the copy
    freed_at: float | None = None  # when ttl cleanup freed it (no use since)
    # node -> shards it handed off within this copy and still holds, kept until their owner
    # here holds them (then trimmed); see split_handed_off.
    handed_off: dict[str, list[int]] = field(default_factory=dict)
    # Shards whose new owner reported failed blocks in a hand-off's fill: their owner's byte
    # count proves nothing (other blocks read through can make up the bytes), so the nodes that
    # handed them off keep them until a later fill copies them without a failure
    # (see split_handed_off).
    failed_in_fill: list[int] = field(default_factory=list)

    def to_json(self) -> JsonDoc:
        return {
            "nodes": self.nodes,
            "created_at": self.created_at,
            "origin": self.origin,
            "fill": self.fill.to_json() if self.fill else None,
            "last_used_at": self.last_used_at,
            "freed_at": self.freed_at,
            "handed_off": self.handed_off,
            "failed_in_fill": self.failed_in_fill,
        }

    @classmethod
    def from_json(cls, data: JsonDoc | list[str] | None) -> CopyState:
        if data is None or isinstance(data, list):  # before copies had metadata: the node list
            return cls(nodes=data)
        fill = data.get("fill")
        return cls(
            nodes=data["nodes"],
            created_at=data.get("created_at", 0.0),
            origin=data.get("origin", "dataset add"),
            fill=FillState(**fill) if fill else None,
            last_used_at=data.get("last_used_at", 0.0),
            freed_at=data.get("freed_at"),
            handed_off=data.get("handed_off", {}),
            failed_in_fill=data.get("failed_in_fill", []),
        )


def split_handed_off(
    node: str,
    held: Mapping[int, int],
    owned: set[int],
    owners: Mapping[int, str | None],
    owner_holds: Mapping[str, Mapping[int, int]],
    failed_in_fill: Collection[int] = (),
) -> tuple[set[int], set[int]]:
    """**The hand-off invariant: a node drops a shard only once another node holds it.**

    For one ``node`` that held data of a copy before a hand-off: ``held`` is its bytes per
    shard (its heartbeat), ``owned`` the shards it owns now in its own copy (never dropped),
    ``owners`` each shard's owner in the copy now (live nodes), ``owner_holds`` those owners'
    cached bytes per shard (their heartbeats), ``failed_in_fill`` the shards where copying a
    block to their owner failed in a fill. Returns (``trim``, ``wait``): the shards it holds
    and does not own, none of whose blocks failed in a fill, whose owner holds at least as many
    bytes of them (safe to drop: the copy keeps every block, and readers already go to that
    owner), and the others, which it keeps.

    Counting bytes, not "the fill said done", is what makes this hold whatever went wrong:
    a fill that never ran (the bug where fill ids repeated across datasets), a block that
    failed to copy, an owner that evicted what it copied, or a trim from an earlier hand-off
    still queued when the next scale starts. Bytes alone do not prove the same blocks: a block
    that failed to copy stays here only, and the owner may make up its bytes with other blocks
    of the shard read through from the store; so a shard with failed blocks in a fill waits
    whatever the bytes say. A kept shard costs only cache space: it is trimmed once its owner
    holds it (read through, preloaded; a failed one once a later fill copied it) and freed by
    cleanup.
    """
    trim: set[int] = set()
    wait: set[int] = set()
    for shard, nbytes in held.items():
        if nbytes <= 0 or shard in owned:
            continue
        owner = owners[shard]
        if shard in failed_in_fill:
            wait.add(shard)
        elif owner not in (None, node) and owner_holds.get(owner, {}).get(shard, 0) >= nbytes:
            trim.add(shard)
        else:
            wait.add(shard)
    return trim, wait


def next_copy_id(existing: Iterable[str]) -> str:
    """A, B, … Z, then A2, B2, …: short names users can type."""
    taken = set(existing)
    round_ = 1
    while True:
        for letter in string.ascii_uppercase:
            name = letter if round_ == 1 else f"{letter}{round_}"
            if name not in taken:
                return name
        round_ += 1


@dataclass(frozen=True)
class RankedNode:
    node: str
    in_copy: bool
    cached_bytes: int
    fraction: float
    why: str

    def to_json(self) -> JsonDoc:
        return asdict(self)


@dataclass
class Locality:
    """What ranking needs: the dataset's size and each live node's cached bytes of it."""

    dataset_bytes: int
    cached: Mapping[str, int] = field(default_factory=dict)

    def fraction(self, node: str) -> float:
        if not self.dataset_bytes:
            return 0.0
        return min(1.0, self.cached.get(node, 0) / self.dataset_bytes)


def rank_nodes(
    candidates: Iterable[str], copy_id: str, copy_nodes: Iterable[str], locality: Locality
) -> list[RankedNode]:
    """TDCS: S3 = the copy's nodes ∩ the candidates S2 first, most cached bytes first (they hold
    the shards the job reads locally); then the rest of S2 by cached fraction (what earlier
    copies or preloads left there). Ties go by name, so the answer is deterministic."""
    members = set(copy_nodes)
    s2 = sorted(set(candidates))
    s3 = sorted((n for n in s2 if n in members), key=lambda n: (-locality.cached.get(n, 0), n))
    rest = sorted((n for n in s2 if n not in members), key=lambda n: (-locality.fraction(n), n))
    ranked = []
    for node in s3:
        cached = locality.cached.get(node, 0)
        why = f"in copy {copy_id}, holds {locality.fraction(node):.0%} of the dataset"
        ranked.append(RankedNode(node, True, cached, locality.fraction(node), why))
    for node in rest:
        fraction = locality.fraction(node)
        why = f"outside copy {copy_id}: reads from its peers" + (
            f", holds {fraction:.0%} of the dataset" if fraction else ""
        )
        ranked.append(RankedNode(node, False, locality.cached.get(node, 0), fraction, why))
    return ranked


def choose_copy(
    open_copies: list[tuple[str, list[str]]], candidates: set[str], locality: Locality
) -> str | None:
    """Among copies with room (id, live nodes — in creation order), the one whose nodes cover
    most of the candidates, then the one holding the most bytes there, then the oldest."""
    best, best_score = None, None
    for order, (copy_id, nodes) in enumerate(open_copies):
        on_candidates = [n for n in nodes if n in candidates]
        score = (len(on_candidates), sum(locality.cached.get(n, 0) for n in on_candidates), -order)
        if best_score is None or score > best_score:
            best, best_score = copy_id, score
    return best


def clone_nodes(
    candidates: Iterable[str], in_copies: set[str], free_cache: Mapping[str, int], wanted: int
) -> list[str] | None:
    """Nodes for a new copy: candidates outside every existing copy, most free cache first;
    None when fewer than ``wanted`` exist."""
    outside = sorted(
        (n for n in set(candidates) if n not in in_copies),
        key=lambda n: (-free_cache.get(n, 0), n),
    )
    return outside[:wanted] if len(outside) >= wanted else None
