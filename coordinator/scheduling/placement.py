"""Ways to turn "k GPUs" into "these GPUs on these nodes", shared by the policies.

All functions take ``free`` (node -> free GPUs) and never modify it; they return a placement
(node -> GPUs) or None when the free GPUs cannot hold the request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping

from .model import Placement


def fill_in_order(
    free: Mapping[str, int], gpus: int, order: Iterable[str]
) -> dict[str, int] | None:
    """Take GPUs from nodes in ``order``, as many as each has, until ``gpus`` are found."""
    placement: dict[str, int] = {}
    needed = gpus
    for node in order:
        if needed == 0:
            break
        take = min(free.get(node, 0), needed)
        if take > 0:
            placement[node] = take
            needed -= take
    return placement if needed == 0 else None


def first_fit(
    free: Mapping[str, int], gpus: int, preference: Callable[[str], float] | None = None
) -> dict[str, int] | None:
    """A plain cluster scheduler: one node if any holds the job whole, else fill nodes in order.

    The order is by name, or by ``preference`` (higher first, ties by name) for "+locality".
    """
    prefer = preference or (lambda _node: 0.0)
    order = sorted((node for node in free if free[node] > 0), key=lambda n: (-prefer(n), n))
    whole = [node for node in order if free[node] >= gpus]
    if whole:
        return {whole[0]: gpus}
    return fill_in_order(free, gpus, order)


def random_fit(
    free: Mapping[str, int],
    gpus: int,
    rng: random.Random,
    preference: Callable[[str], float] | None = None,
) -> dict[str, int] | None:
    """Random placement: nodes with free GPUs in a random order, filled greedily.

    With ``preference`` ("+locality") more preferred nodes come first; ties stay random.
    """
    order = sorted(node for node, count in free.items() if count > 0)
    rng.shuffle(order)
    if preference is not None:
        order.sort(key=lambda n: -preference(n))  # stable: keeps the shuffle within ties
    return fill_in_order(free, gpus, order)


def best_fit(
    free: Mapping[str, int],
    gpus: int,
    preference: Callable[[str], float] | None = None,
) -> dict[str, int] | None:
    """P2's best fit for one job.

    Nodes with free GPUs are sorted ascending by free count; the job goes on the first node that
    holds it whole. If none does, the node with the most free GPUs takes as much as it can and
    the remainder is placed the same way. ``preference`` (higher first, e.g. cached bytes of the
    job's dataset) is the "+locality" variant: among nodes that fit it picks the most preferred
    (ties by best fit), and when splitting it takes the most preferred node first (ties by most
    free GPUs).
    """
    remaining = {node: count for node, count in free.items() if count > 0}
    if sum(remaining.values()) < gpus:
        return None
    prefer = preference or (lambda _node: 0.0)
    placement: dict[str, int] = {}
    needed = gpus
    while needed > 0:
        fitting = [node for node, count in remaining.items() if count >= needed]
        if fitting:
            node = min(fitting, key=lambda n: (-prefer(n), remaining[n], n))
            placement[node] = placement.get(node, 0) + needed
            return placement
        node = min(remaining, key=lambda n: (-prefer(n), -remaining[n], n))
        placement[node] = placement.get(node, 0) + remaining[node]
        needed -= remaining.pop(node)
    return placement


def best_fit_many(
    free: Mapping[str, int],
    requests: Mapping[str, int],
    preference: Callable[[str, str], float] | None = None,
) -> dict[str, dict[str, int]] | None:
    """P2's best fit for several jobs: largest first, each by :func:`best_fit` on what is left.

    ``preference(job_id, node)`` gives the "+locality" order per job. Returns job -> placement,
    or None when the GPUs do not suffice.
    """
    remaining = dict(free)
    placements: dict[str, dict[str, int]] = {}
    for job_id in sorted(requests, key=lambda j: (-requests[j], j)):
        prefer = None if preference is None else (lambda n, j=job_id: preference(j, n))
        placement = best_fit(remaining, requests[job_id], prefer)
        if placement is None:
            return None
        for node, count in placement.items():
            remaining[node] -= count
        placements[job_id] = placement
    return placements


def symmetric_shapes(free: Mapping[str, int], max_gpus: int) -> list[tuple[int, int]]:
    """P3's feasible symmetric shapes ⟨d_node, d_gpu⟩ with d_node·d_gpu ≤ ``max_gpus``."""
    shapes = []
    for per_node in range(1, max_gpus + 1):
        nodes_with_room = sum(1 for count in free.values() if count >= per_node)
        for node_count in range(1, min(nodes_with_room, max_gpus // per_node) + 1):
            shapes.append((node_count, per_node))
    return shapes


def place_shape(
    free: Mapping[str, int],
    node_count: int,
    per_node: int,
    preference: Callable[[str], float] | None = None,
) -> dict[str, int] | None:
    """Pick ``node_count`` nodes with ≥ ``per_node`` free GPUs: most preferred, then tightest."""
    prefer = preference or (lambda _node: 0.0)
    fitting = sorted(
        (node for node, count in free.items() if count >= per_node),
        key=lambda n: (-prefer(n), free[n], n),
    )
    if len(fitting) < node_count:
        return None
    return {node: per_node for node in fitting[:node_count]}


def nodes_spanned(placement: Placement) -> int:
    return sum(1 for count in placement.values() if count > 0)
