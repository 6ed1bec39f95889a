"""What a preload job selects: per shard, the objects and blocks to fetch.

Pure functions over a snapshot (no I/O, no cache): every node computes the same plan for the same
job and snapshot, so nodes agree on the selection without talking. The preloader
(``preload.py``) runs the shards this node owns; fills (``fill.py``) plan the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from cachefs.cache.base import key_hash_of
from cachefs.meta import Entry, Snapshot
from cachefs.protocol import SHARDS


@dataclass(frozen=True, slots=True)
class PlannedObject:
    key: str
    etag: str
    size: int
    blocks: tuple[int, ...]  # selected block indices
    selected_bytes: int


def path_matches(key: str, prefixes: tuple[str, ...]) -> bool:
    """Path-prefix match by whole components: "train" selects "train/x", not "training/x"."""
    if not prefixes:
        return True
    return any(key == p or key.startswith(p + "/") for p in prefixes)


def plan(
    snapshot: Snapshot,
    selection: dict[str, Any],
    block_size: int,
    shards: AbstractSet[int] | None = None,
    *,
    elsewhere: list[str] | None = None,
    elsewhere_max: int = 0,
) -> dict[int, list[PlannedObject]]:
    """The blocks a job selects, per shard (only ``shards`` if given). ``elsewhere``, if
    given, receives the keys of up to ``elsewhere_max`` files under the job's paths in the
    other shards (this node reads them from their owners; the preload prepares their LOOKUP
    replies all the same), from the same walk.

    Within a shard, objects are taken in the order of their key hash (deterministic on every
    node, and spread over the namespace) and blocks in file order. With a ``fraction`` f, each
    shard takes the prefix of its blocks whose size is nearest to f × its bytes plus the error
    carried from the shards before it (error diffusion in shard order): every shard is within
    one block of its share, and the whole selection within half a block of f × the bytes, even
    when shards hold only a few files each. Every node walks the whole snapshot and computes
    the carry the same way, so nodes agree without talking. A byte budget b is the fraction
    b / (bytes under the paths).
    """
    prefixes = tuple(p.strip("/") for p in selection.get("paths") or () if p.strip("/"))
    # Per shard, every selected file as one int, hash << 48 | size: sorting orders by hash;
    # the carry needs only the sizes. Entries are kept for the shards to plan.
    sizes: list[list[int]] = [[] for _ in range(SHARDS)]
    entries: dict[int, list[tuple[int, Entry]]] = defaultdict(list)
    total = 0
    for entry in snapshot.iter_files():
        if not path_matches(entry.key, prefixes):
            continue
        key_hash = key_hash_of(entry.key)
        shard = key_hash % SHARDS
        total += entry.size
        sizes[shard].append(key_hash << 48 | entry.size)
        if shards is None or shard in shards:
            entries[shard].append((key_hash, entry))
        elif elsewhere is not None and len(elsewhere) < elsewhere_max:
            elsewhere.append(entry.key)
    fraction = selection.get("fraction")
    if selection.get("bytes") is not None:
        fraction = min(1.0, selection["bytes"] / total) if total else 1.0

    planned: dict[int, list[PlannedObject]] = {}
    carry = 0.0
    size_mask = (1 << 48) - 1
    for shard in range(SHARDS):
        budget = None
        if fraction is not None:
            shard_sizes = [packed & size_mask for packed in sorted(sizes[shard])]
            budget = _ShardBudget(fraction * sum(shard_sizes) + carry)
            for size in shard_sizes:
                if not budget.take_file(size, block_size):
                    break
            carry = budget.target - budget.taken
        if shard not in entries:
            continue
        objects = []
        budget = None if budget is None else _ShardBudget(budget.target)
        for _, entry in sorted(entries[shard], key=lambda pair: (pair[0], pair[1].size)):
            blocks = _blocks_of(entry.size, block_size)
            if budget is not None:
                blocks = blocks[: budget.blocks_taken(entry.size, block_size)]
            if not blocks:
                break
            selected = sum(min(block_size, entry.size - i * block_size) for i in blocks)
            objects.append(
                PlannedObject(entry.key, entry.etag, entry.size, tuple(blocks), selected)
            )
            if budget is not None and len(blocks) < len(_blocks_of(entry.size, block_size)):
                break
        planned[shard] = objects
    return planned


def _blocks_of(size: int, block_size: int) -> list[int]:
    return list(range(max(1, -(-size // block_size))))


class _ShardBudget:
    """Takes blocks in order while that brings the bytes taken nearer to the target."""

    def __init__(self, target: float):
        self.target = target
        self.taken = 0
        self.stopped = False

    def blocks_taken(self, size: int, block_size: int) -> int:
        """How many leading blocks of a ``size``-byte file to take (stops for good once a
        block is refused: a shard's selection is a prefix)."""
        count = 0
        for index in _blocks_of(size, block_size):
            length = min(block_size, size - index * block_size)
            if self.stopped or self.taken + length / 2 > self.target:
                self.stopped = True
                return count
            self.taken += length
            count += 1
        return count

    def take_file(self, size: int, block_size: int) -> bool:
        """Take what fits of one file; False once the shard's share is reached."""
        blocks = len(_blocks_of(size, block_size))
        return self.blocks_taken(size, block_size) == blocks and not self.stopped
