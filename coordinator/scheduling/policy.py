"""The policy interface and the pieces every policy shares.

A policy gets a :class:`ClusterState` and answers:

- ``schedule(state)``: decisions for the whole queue (start / resize / wait / clone), used by the
  simulator at every arrival, completion and wake-up;
- ``place(job, state)``: where one job would go right now and why, used by the placement
  endpoint (a real scheduler asking);
- ``next_wakeup(state)``: a future time the policy wants to be asked again (leases, quanta).

"+locality" variants (``locality=True``) add the cost of reading uncached data to the policy's
own time model (see :mod:`.locality`) and prefer nodes that hold the job's data.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

from .locality import cached_on, io_seconds, with_io
from .model import (
    ClusterState,
    Decision,
    JobSpec,
    JobState,
    NodeScore,
    Placement,
    PlacementChoice,
    SchedulingError,
    Start,
    Wait,
)
from .perf import compute_seconds
from .placement import best_fit

#: A placement function: (free GPUs per node, GPUs wanted, node preference) -> placement or None.
Fit = Callable[[Mapping[str, int], int, Callable[[str], float] | None], Placement | None]


class Policy(ABC):
    """Base class: subclasses set ``base_name`` and implement :meth:`place`."""

    base_name: ClassVar[str]
    #: Whether :meth:`schedule` keeps every job on its ``candidates`` (P2's and Themis'
    #: rounds place by GPU count on the whole cluster, so they do not).
    honours_candidates: ClassVar[bool] = True

    def __init__(self, *, locality: bool = False) -> None:
        self.locality = locality

    @property
    def name(self) -> str:
        return self.base_name + ("+locality" if self.locality else "")

    @abstractmethod
    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        """Where ``job`` would start now on the free GPUs of ``state``; None = it must wait."""

    def schedule(self, state: ClusterState) -> list[Decision]:
        """Default: strict FIFO over the queue, each job placed by :meth:`place`."""
        return fifo_schedule(self, state, state.waiting)

    def next_wakeup(self, state: ClusterState) -> float | None:
        return None

    # --- helpers for subclasses ---------------------------------------------------------

    def predicted_seconds(
        self, spec: JobSpec, placement: Placement, state: ClusterState, samples: float
    ) -> float:
        """The policy's time model: compute, plus the I/O stall under "+locality"."""
        compute = compute_seconds(spec, placement, samples)
        if not self.locality:
            return compute
        return with_io(compute, io_seconds(spec, placement, state, samples))

    def io_seconds_on(self, spec: JobSpec, gpus: int, state: ClusterState, samples: float) -> float:
        """I/O seconds of ``samples`` on the nodes a best fit of ``gpus`` GPUs would pick,
        counting every GPU as free (for policies that reason about GPU counts, not nodes)."""
        all_gpus = {name: node.gpus for name, node in state.nodes.items()}
        placement = best_fit(all_gpus, gpus, self.preference(spec, state))
        return io_seconds(spec, placement or {}, state, samples)

    def fit_and_rank(
        self,
        job: JobSpec,
        state: ClusterState,
        fit: Fit,
        unpreferred: Callable[[Mapping[str, int], str], float],
    ) -> tuple[Placement, tuple[NodeScore, ...]] | None:
        """What placing one job on the free GPUs of its candidates takes: ``fit`` its GPUs there
        with the node preference of "+locality", and rank the nodes by that preference, else by
        ``unpreferred(free GPUs, node)``. None when it does not fit."""
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = fit(free, job.gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda node: unpreferred(free, node))
        return placement, ranking(job, state, score, free)

    def preference(self, spec: JobSpec, state: ClusterState) -> Callable[[str], float] | None:
        """Node preference for "+locality": cached bytes of the job's dataset; None otherwise."""
        if not self.locality:
            return None
        dataset = state.dataset(spec.dataset)
        return lambda node: float(cached_on(dataset, node))


def ranking(
    spec: JobSpec,
    state: ClusterState,
    score: Callable[[str], float],
    free: Mapping[str, int] | None = None,
) -> tuple[NodeScore, ...]:
    """Nodes with free GPUs, best first by ``score`` (ties by name)."""
    free = state.free_gpus() if free is None else free
    dataset = state.dataset(spec.dataset)
    rows = [
        NodeScore(node, score(node), free[node], cached_on(dataset, node))
        for node in free
        if free[node] > 0
    ]
    rows.sort(key=lambda row: (-row.score, row.node))
    return tuple(rows)


def candidate_free(spec: JobSpec, free: Mapping[str, int]) -> dict[str, int]:
    """Free GPUs restricted to the job's candidate nodes (all nodes when it names none)."""
    if spec.candidates is None:
        return dict(free)
    return {node: count for node, count in free.items() if node in spec.candidates}


def with_free(state: ClusterState, free: Mapping[str, int]) -> ClusterState:
    """A copy of ``state`` whose nodes have the given free GPU counts."""
    nodes = {
        name: dataclasses.replace(node, free_gpus=free[name]) for name, node in state.nodes.items()
    }
    return dataclasses.replace(state, nodes=nodes)


def take(free: dict[str, int], placement: Placement) -> None:
    """Remove ``placement``'s GPUs from ``free`` (in place), refusing to go below zero."""
    for node, count in placement.items():
        if free.get(node, 0) < count:
            raise SchedulingError(
                f"placement asks {count} GPUs on {node!r} but only {free.get(node, 0)} are free"
            )
        free[node] -= count


def fifo_schedule(policy: Policy, state: ClusterState, queue: Iterable[JobState]) -> list[Decision]:
    """Place jobs in ``queue`` order with ``policy.place``; the first job that does not fit
    blocks the ones behind it (what a plain FIFO scheduler does)."""
    free = state.free_gpus()
    decisions: list[Decision] = []
    blocked = False
    for job in queue:
        if blocked:
            decisions.append(Wait(job.job_id, "behind an earlier job in FIFO order"))
            continue
        choice = policy.place(job.spec, with_free(state, free))
        if choice is None:
            decisions.append(Wait(job.job_id, "not enough free GPUs"))
            blocked = True
            continue
        take(free, choice.placement)
        decisions.append(Start(job.job_id, choice.placement, choice.explanation))
    return decisions
