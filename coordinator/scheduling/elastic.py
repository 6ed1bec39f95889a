"""P2: elastic scaling for a training service with exclusive GPUs.

Principles: FCFS; a new request starts at once if a GPU is free; every running job keeps at
least one GPU; jobs are rescaled when GPUs free up or requests arrive (a rescaled job
checkpoints and restarts).

- Epoch-time model f_i(g): starts from a default (the job's profile), then a least-squares fit
  to the measured (GPUs, epoch seconds) points: ``f(g) = a/g + b + c·g`` with a, b, c ≥ 0
  (non-negative least squares: compute that divides across GPUs, a fixed part, and a
  communication part that grows with GPUs). With two distinct GPU counts only ``a/g + b`` is
  fitted; with one, the default curve is scaled through the measured point.
- Expansion (K idle GPUs, no new requests): increments maximising
  Σ (f_i(s_i) − f_i(s_i+inc_i))·job_i with Σ inc_i ≤ K, ``job_i`` = remaining epochs.
- Reduction (K new requests, no idle GPUs): reclaim K' = min(K, P − m) GPUs with decrements
  minimising Σ (f_i(s_i − dec_i) − f_i(s_i))·job_i, Σ dec_i = K', s_i − dec_i ≥ 1.
- Both are grouped 0/1 knapsacks solved by dynamic programming (:mod:`.knapsack`).
- Placement: best fit (:func:`.placement.best_fit_many`) of the jobs that start or restart.

"+locality": f_i(g) becomes max(f_i(g), I/O seconds of one epoch on the best-fit placement of
g GPUs), and best fit prefers nodes holding the job's data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from .fitting import nonnegative_least_squares
from .knapsack import solve_grouped_knapsack
from .model import (
    ClusterState,
    Decision,
    JobSpec,
    JobState,
    PlacementChoice,
    Resize,
    Start,
    Wait,
)
from .perf import estimated_rate, packed_shape
from .placement import best_fit, best_fit_many
from .policy import Policy, candidate_free, ranking

EpochTime = Callable[[int], float]
#: A known epoch-time curve: (job, GPUs) -> seconds per epoch.
KnownEpochTime = Callable[[JobSpec, int], float]

_USELESS_S = 1e12


def fit_epoch_time(observations: Sequence[tuple[int, float]], default: EpochTime) -> EpochTime:
    """P2's epoch-time model from measured (GPUs, seconds per epoch) points."""
    if not observations:
        return default
    seconds = [t for _, t in observations]
    distinct = len({g for g, _ in observations})
    if distinct == 1:
        # One GPU count measured: keep the default's shape, pass through the mean measurement.
        scale = sum(seconds) / len(seconds) / default(observations[0][0])
        return lambda g: scale * default(g)
    rows = [(1.0 / g, 1.0, float(g)) if distinct >= 3 else (1.0 / g, 1.0) for g, _ in observations]
    a, b, *rest = nonnegative_least_squares(rows, seconds)
    c = rest[0] if rest else 0.0
    return lambda g: a / g + b + c * g


class ElasticPolicy(Policy):
    """P2's elastic scaling with best-fit placement."""

    base_name = "p2-elastic"
    honours_candidates = False

    def __init__(
        self, *, locality: bool = False, known_epoch_time: KnownEpochTime | None = None
    ) -> None:
        """``known_epoch_time`` replaces the fitted model by a given curve (experiments use the
        simulator's true curve to separate the knapsacks' choices from the fit's errors)."""
        super().__init__(locality=locality)
        self.known_epoch_time = known_epoch_time

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        fitted = self.fit_and_rank(job, state, best_fit, lambda free, node: -free[node])
        if fitted is None:
            return None
        how = " preferring cached data" if self.locality else ""
        return PlacementChoice(*fitted, f"best fit of {job.gpus} GPUs{how}")

    def schedule(self, state: ClusterState) -> list[Decision]:
        total_gpus = state.total_gpus
        idle = sum(state.free_gpus().values())
        targets = {job.job_id: job.gpus_held for job in state.running}
        jobs = {job.job_id: job for job in (*state.running, *state.waiting)}
        models = {job_id: self._epoch_model(job, state) for job_id, job in jobs.items()}

        # FCFS: every waiting job gets one GPU at once while GPUs are idle.
        queue = list(state.waiting)
        while queue and idle > 0:
            targets[queue.pop(0).job_id] = 1
            idle -= 1

        if queue:
            # Reduction: free K' GPUs for the next K' requests; every job keeps one GPU.
            reclaim = min(len(queue), total_gpus - len(targets))
            if reclaim > 0:
                running = [job_id for job_id in targets if targets[job_id] > 1]
                decrements = self._reduce(running, targets, models, jobs, reclaim)
                for job_id, dec in zip(running, decrements, strict=True):
                    targets[job_id] -= dec
                for _ in range(reclaim):
                    targets[queue.pop(0).job_id] = 1
        elif idle > 0:
            ordered = list(targets)
            increments = self._expand(ordered, targets, models, jobs, idle, total_gpus)
            for job_id, inc in zip(ordered, increments, strict=True):
                targets[job_id] += inc

        decisions = self._place(state, targets, jobs)
        decisions += [Wait(job.job_id, "every GPU is held; waiting for one") for job in queue]
        return decisions

    # --- the model -----------------------------------------------------------------------

    def _epoch_model(self, job: JobState, state: ClusterState) -> EpochTime:
        spec = job.spec
        per_node = max((node.gpus for node in state.nodes.values()), default=1)

        def default(g: int) -> float:
            rate = estimated_rate(spec, packed_shape(g, per_node))
            # A placement that communication makes useless gets a huge, finite time so that
            # differences of times stay numbers.
            return spec.samples_per_epoch / rate if rate > 0 else _USELESS_S

        fitted = (
            fit_epoch_time(job.observations, default)
            if self.known_epoch_time is None
            else functools.partial(self.known_epoch_time, spec)
        )
        if not self.locality:
            return fitted
        return lambda g: max(fitted(g), self.io_seconds_on(spec, g, state, spec.samples_per_epoch))

    # --- the two knapsacks ----------------------------------------------------------------

    def _expand(
        self,
        job_ids: list[str],
        targets: dict[str, int],
        models: dict[str, EpochTime],
        jobs: dict[str, JobState],
        idle: int,
        total_gpus: int,
    ) -> list[int]:
        values = []
        for job_id in job_ids:
            f, now, left = models[job_id], targets[job_id], _epochs_left(jobs[job_id])
            cap = jobs[job_id].spec.max_gpus or total_gpus
            room = max(0, min(idle, cap - now))
            values.append([(f(now) - f(now + inc)) * left for inc in range(room + 1)])
        _gain, increments = solve_grouped_knapsack(values, idle)
        return increments

    def _reduce(
        self,
        job_ids: list[str],
        targets: dict[str, int],
        models: dict[str, EpochTime],
        jobs: dict[str, JobState],
        reclaim: int,
    ) -> list[int]:
        values = []
        for job_id in job_ids:
            f, now, left = models[job_id], targets[job_id], _epochs_left(jobs[job_id])
            # Minimising the added time = maximising its negative.
            values.append([-(f(now - dec) - f(now)) * left for dec in range(now)])
        _loss, decrements = solve_grouped_knapsack(values, reclaim, exact=True)
        return decrements

    # --- placement -----------------------------------------------------------------------

    def _place(
        self, state: ClusterState, targets: dict[str, int], jobs: dict[str, JobState]
    ) -> list[Decision]:
        """Best fit for every job that starts or changes size; the others stay where they are."""
        free = state.free_gpus()
        moving = {}
        for job_id, gpus in targets.items():
            job = jobs[job_id]
            if gpus != job.gpus_held:
                moving[job_id] = gpus
                for node, count in job.placement.items():
                    free[node] += count
        if not moving:
            return []

        preferences = {job_id: self.preference(jobs[job_id].spec, state) for job_id in moving}

        def prefer(job_id: str, node: str) -> float:
            rank = preferences[job_id]
            return rank(node) if rank else 0.0

        placements = best_fit_many(free, moving, prefer if self.locality else None)
        assert placements is not None, "targets never exceed the cluster's GPUs"
        decisions: list[Decision] = []
        for job_id, placement in placements.items():
            if jobs[job_id].placement:
                decisions.append(Resize(job_id, placement, f"rescaled to {moving[job_id]} GPUs"))
            else:
                decisions.append(Start(job_id, placement, f"started on {moving[job_id]} GPUs"))
        return decisions


def _epochs_left(job: JobState) -> float:
    return job.remaining_samples / job.spec.samples_per_epoch


class EarliestFinishPolicy(Policy):
    """P2's EF baseline: each job in FIFO order gets every GPU of the cluster."""

    base_name = "p2-earliest-finish"

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        if state.running or any(free[n] < state.nodes[n].gpus for n in free):
            return None
        placement = {node: count for node, count in free.items() if count > 0}
        score = self.preference(job, state) or (lambda node: float(free[node]))
        return PlacementChoice(
            placement,
            ranking(job, state, score, free),
            f"earliest finish: all {sum(placement.values())} GPUs",
        )
