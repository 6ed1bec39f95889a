"""The "+locality" cost: how long a job waits on data it reads from peers or the object store.

Every policy's "+locality" variant adds this to its own time model. The estimate follows the
cache's read path: a node of the job finds a sample in its own cache (local), in another
node's cache (peer read, no local duplicate), or nowhere (object store, then admitted to the
cache while there is room). Data loading is pipelined with compute, so a job's time is the
slower of the two: ``max(compute, io)`` — the I/O cost is the stall beyond compute.

Assumptions (the policies cannot know more at decision time):
- each node reads a share of every epoch proportional to its GPUs;
- the job is the only reader of the store, getting ``min(store_per_node, store_total / nodes)``
  per node;
- misses of the first epoch are admitted to free cache space on the job's nodes, so later
  epochs read them locally (on the owning node) or from a peer (on the others).
"""

from __future__ import annotations

from .model import ClusterState, Dataset, IoBandwidth, JobSpec, Placement


def cached_on(dataset: Dataset | None, node: str) -> int:
    """Bytes of ``dataset`` cached on ``node`` (0 when there is no dataset)."""
    if dataset is None:
        return 0
    return min(dataset.size, dataset.cached.get(node, 0))


def _epoch_seconds(
    placement: Placement,
    dataset: Dataset,
    io: IoBandwidth,
    local_bytes: dict[str, float],
    cached_total: float,
) -> float:
    """Seconds one epoch's reads take on the slowest node of the placement."""
    size = float(dataset.size)
    total_gpus = sum(placement.values())
    store_share = min(io.store_per_node, io.store_total / len(placement))
    slowest = 0.0
    for node, gpus in placement.items():
        local = min(local_bytes.get(node, 0.0), cached_total)
        peer = cached_total - local
        miss = size - cached_total
        share = gpus / total_gpus
        seconds = share * (local / io.local_per_node + peer / io.peer_per_node + miss / store_share)
        slowest = max(slowest, seconds)
    return slowest


def io_seconds(spec: JobSpec, placement: Placement, state: ClusterState, samples: float) -> float:
    """Seconds of reading ``samples`` of the job's dataset on ``placement`` (0 without data)."""
    dataset = state.dataset(spec.dataset)
    if dataset is None or dataset.size == 0 or not placement:
        return 0.0
    epochs = samples / spec.samples_per_epoch
    local_now = {node: float(cached_on(dataset, node)) for node in placement}
    cached_now = float(dataset.cached_total)
    first = _epoch_seconds(placement, dataset, state.io, local_now, cached_now)
    if epochs <= 1.0:
        return first * epochs

    # The first epoch's misses land in free cache space on the job's nodes, spread evenly.
    room = sum(
        max(0, state.nodes[node].cache_capacity - state.nodes[node].cache_used)
        for node in placement
        if node in state.nodes
    )
    admitted = min(dataset.size - cached_now, float(room))
    local_later = {node: held + admitted / len(placement) for node, held in local_now.items()}
    later = _epoch_seconds(placement, dataset, state.io, local_later, cached_now + admitted)
    return first + (epochs - 1.0) * later


def with_io(compute_s: float, io_s: float) -> float:
    """A job's time when loading is pipelined with compute: the slower of the two."""
    return max(compute_s, io_s)
