"""What a plain cluster scheduler does: FIFO order, first-fit or random placement."""

from __future__ import annotations

import random

from .model import ClusterState, JobSpec, PlacementChoice
from .placement import first_fit, random_fit
from .policy import Policy


class FifoPolicy(Policy):
    """Strict FIFO; each job gets the GPUs it asked for on the first node that holds it whole,
    else on nodes in name order. "+locality": nodes holding the job's data come first."""

    base_name = "fifo"

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        fitted = self.fit_and_rank(job, state, first_fit, lambda free, node: 0.0)
        if fitted is None:
            return None
        how = "nodes holding the most cached data first" if self.locality else "nodes in name order"
        return PlacementChoice(*fitted, f"FIFO, first fit ({how}): {job.gpus} GPUs")


class RandomPolicy(Policy):
    """Strict FIFO; GPUs taken from nodes in a random (seeded) order.
    "+locality": nodes holding the job's data come first, random among equals."""

    base_name = "random"

    def __init__(self, *, locality: bool = False, seed: int = 0) -> None:
        super().__init__(locality=locality)
        self._rng = random.Random(seed)

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        fitted = self.fit_and_rank(
            job,
            state,
            lambda free, gpus, prefer: random_fit(free, gpus, self._rng, prefer),
            lambda free, node: 0.0,
        )
        if fitted is None:
            return None
        return PlacementChoice(*fitted, f"random placement of {job.gpus} GPUs")
