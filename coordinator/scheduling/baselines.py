"""What a plain cluster scheduler does: FIFO order, first-fit or random placement."""

from __future__ import annotations

import random

from .model import ClusterState, JobSpec, PlacementChoice
from .placement import first_fit, random_fit
from .policy import Policy, candidate_free, ranking


class FifoPolicy(Policy):
    """Strict FIFO; each job gets the GPUs it asked for on the first node that holds it whole,
    else on nodes in name order. "+locality": nodes holding the job's data come first."""

    base_name = "fifo"

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = first_fit(free, job.gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda _node: 0.0)
        how = "nodes holding the most cached data first" if prefer else "nodes in name order"
        return PlacementChoice(
            placement,
            ranking(job, state, score, free),
            f"FIFO, first fit ({how}): {job.gpus} GPUs",
        )


class RandomPolicy(Policy):
    """Strict FIFO; GPUs taken from nodes in a random (seeded) order.
    "+locality": nodes holding the job's data come first, random among equals."""

    base_name = "random"

    def __init__(self, *, locality: bool = False, seed: int = 0) -> None:
        super().__init__(locality=locality)
        self._rng = random.Random(seed)

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = random_fit(free, job.gpus, self._rng, prefer)
        if placement is None:
            return None
        score = prefer or (lambda _node: 0.0)
        return PlacementChoice(
            placement, ranking(job, state, score, free), f"random placement of {job.gpus} GPUs"
        )
