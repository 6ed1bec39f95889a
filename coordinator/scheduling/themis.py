"""P5: Themis (finish-time fair auctions with leases) and its Tiresias-like LAS baseline.

Finish-time fairness ρ = T_shared / T_independent, T_independent = the time on a private 1/N
share of the cluster (N = apps present). Each job is one app here (Themis' apps with several
jobs would pool their bids; the simulator's workloads have one job per app).

Themis round (at every arrival, completion and lease expiry):
1. GPUs that are idle or whose lease expired form the pool; an app whose lease expired holds
   nothing until it wins again.
2. The pool is offered to the ``ceil((1 − f)·N)`` apps with the worst ρ (fairness knob f).
3. Each offered app bids ρ for every number of extra GPUs (up to its demand), estimated by its
   profile on a compact placement. Zero GPUs is valued as "wait one more lease, then run on a
   fair 1/N share", so every bid is finite.
4. Partial-allocation auction: the allocation maximising Π 1/ρ (Nash social welfare, a grouped
   knapsack in log space); each winner keeps the fraction c_i = Π_{j≠i} V_j(A) / Π_{j≠i} V_j(A_-i)
   of its GPUs (rounded to the nearest GPU), the hidden payment for the harm it does to others.
5. Leftovers (withheld or unoffered GPUs) go to the other apps, worst ρ first (work conserving).
6. Every grant is a lease of ``lease_s``; expiring leases bring the GPUs back to step 1. An app
   that wins back the same count keeps its GPUs (no restart).

"+locality": remaining time includes the I/O stall and placements prefer cached nodes.

Tiresias LAS: discretised least-attained-service (GPU-seconds) queues, FIFO within a queue,
preemptive, each job gang-scheduled on exactly the GPUs it asked for, consolidated placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .knapsack import solve_grouped_knapsack
from .locality import with_io
from .model import (
    ClusterState,
    Decision,
    JobSpec,
    JobState,
    Placement,
    PlacementChoice,
    Resize,
    SchedulingError,
    Start,
    Wait,
)
from .perf import estimated_rate, packed_shape
from .placement import best_fit, best_fit_many, first_fit
from .policy import Policy, candidate_free, ranking, with_free


def finish_time_fairness(shared_s: float, independent_s: float) -> float:
    """ρ = T_shared / T_independent."""
    return shared_s / independent_s


def independent_seconds(
    spec: JobSpec,
    total_gpus: int,
    apps: float,
    per_node: int,
    rate_of: Callable[[JobSpec, Placement], float] = estimated_rate,
) -> float:
    """T_independent: the whole job alone on a 1/``apps`` share of the cluster, compactly placed
    (a share below one GPU is a time-slice of it). ``rate_of`` predicts samples/s: the job's
    profile here, the ground truth in the simulator."""
    share = total_gpus / max(apps, 1.0)
    gpus = max(1, min(spec.gpu_cap, int(share)))
    rate = rate_of(spec, packed_shape(gpus, per_node))
    if share < 1:
        rate *= share
    return spec.samples / rate


# --- the partial-allocation auction ------------------------------------------------------------


@dataclass(frozen=True)
class AuctionResult:
    """Extra GPUs won (the Nash-welfare allocation) and kept (after the hidden payment)."""

    won: dict[str, int]
    kept: dict[str, int]
    fractions: dict[str, float]


def partial_allocation(values: Mapping[str, Sequence[float]], capacity: int) -> AuctionResult:
    """The PA mechanism over identical GPUs: ``values[app][k]`` = app's value (1/ρ > 0) for k
    extra GPUs, k = 0..len-1."""
    apps = sorted(values)
    for app in apps:
        if not values[app] or min(values[app]) <= 0:
            raise SchedulingError(f"app {app!r}: bids must be positive values for 0.. GPUs")
    logs = {app: [math.log(v) for v in values[app]] for app in apps}
    total, counts = solve_grouped_knapsack([logs[a] for a in apps], capacity)
    won = dict(zip(apps, counts, strict=True))
    kept, fractions = {}, {}
    for app in apps:
        if won[app] == 0:
            kept[app], fractions[app] = 0, 1.0
            continue
        others = [a for a in apps if a != app]
        others_with = total - logs[app][won[app]]
        others_without, _ = solve_grouped_knapsack([logs[a] for a in others], capacity)
        fraction = math.exp(min(0.0, others_with - others_without))
        fractions[app] = fraction
        kept[app] = math.floor(fraction * won[app] + 0.5)
    return AuctionResult(won, kept, fractions)


# --- Themis ------------------------------------------------------------------------------------


class ThemisPolicy(Policy):
    """P5's arbiter: rounds, bids, partial-allocation auction, leases."""

    base_name = "p5-themis"
    honours_candidates = False

    def __init__(
        self, *, locality: bool = False, fairness_knob: float = 0.8, lease_s: float = 1200.0
    ) -> None:
        super().__init__(locality=locality)
        if not 0.0 <= fairness_knob < 1.0:
            raise SchedulingError(f"fairness knob f={fairness_knob} must lie in [0, 1)")
        if lease_s <= 0:
            raise SchedulingError(f"lease_s={lease_s} must be positive")
        self.fairness_knob = fairness_knob
        self.lease_s = lease_s
        self._lease_ends: dict[str, float] = {}

    def next_wakeup(self, state: ClusterState) -> float | None:
        ends = [self._lease_ends.get(job.job_id, state.now) for job in state.running]
        later = [end for end in ends if end > state.now]
        return min(later) if later else None

    # --- ρ estimates -----------------------------------------------------------------------

    def _per_node(self, state: ClusterState) -> int:
        return max(node.gpus for node in state.nodes.values())

    def remaining_seconds(self, job: JobState, gpus: int, state: ClusterState) -> float:
        """The app's estimate of its remaining time on ``gpus`` GPUs (compact placement)."""
        rate = estimated_rate(job.spec, packed_shape(gpus, self._per_node(state)))
        if rate <= 0:
            return float("inf")
        compute = job.remaining_samples / rate
        if not self.locality:
            return compute
        return with_io(compute, self.io_seconds_on(job.spec, gpus, state, job.remaining_samples))

    def rho(self, job: JobState, gpus: int, state: ClusterState, apps: int) -> float:
        """ρ if the app holds ``gpus`` from now on; with 0 it waits a lease, then runs on its
        fair share (1/N of the cluster, at most its demand)."""
        if gpus > 0:
            remaining = self.remaining_seconds(job, gpus, state)
        else:
            fair = max(1, min(job.spec.gpu_cap, state.total_gpus // max(apps, 1)))
            remaining = self.lease_s + self.remaining_seconds(job, fair, state)
        shared = state.now - job.spec.arrival + remaining
        independent = independent_seconds(job.spec, state.total_gpus, apps, self._per_node(state))
        return finish_time_fairness(shared, independent)

    # --- one round -------------------------------------------------------------------------

    def schedule(self, state: ClusterState) -> list[Decision]:
        apps = [*state.running, *state.waiting]
        count = len(apps)
        running_ids = {job.job_id for job in state.running}
        self._lease_ends = {j: end for j, end in self._lease_ends.items() if j in running_ids}
        expired = {
            job.job_id
            for job in state.running
            if self._lease_ends.get(job.job_id, state.now) <= state.now
        }
        held = {job.job_id: (0 if job.job_id in expired else job.gpus_held) for job in apps}
        pool = state.free_gpus()
        for job in state.running:
            if job.job_id in expired:
                for node, gpus in job.placement.items():
                    pool[node] += gpus
        capacity = sum(pool.values())

        wanting = [job for job in apps if held[job.job_id] < job.spec.gpu_cap]
        wanting.sort(key=lambda j: (-self.rho(j, held[j.job_id], state, count), j.job_id))
        offered = wanting[: max(1, math.ceil((1.0 - self.fairness_knob) * count))]

        extra = {job.job_id: 0 for job in apps}
        if offered and capacity > 0:
            bids = {
                job.job_id: [
                    1.0 / self.rho(job, held[job.job_id] + k, state, count)
                    for k in range(min(capacity, job.spec.gpu_cap - held[job.job_id]) + 1)
                ]
                for job in offered
            }
            result = partial_allocation(bids, capacity)
            extra.update(result.kept)
            capacity -= sum(result.kept.values())
        # Leftovers: apps outside the auction first, then the offered ones, worst ρ first.
        offered_ids = {job.job_id for job in offered}
        for job in sorted(wanting, key=lambda j: j.job_id in offered_ids):
            give = min(capacity, job.spec.gpu_cap - held[job.job_id] - extra[job.job_id])
            extra[job.job_id] += give
            capacity -= give

        return self._place(state, apps, expired, held, extra, pool)

    def _place(
        self,
        state: ClusterState,
        apps: list[JobState],
        expired: set[str],
        held: dict[str, int],
        extra: dict[str, int],
        pool: dict[str, int],
    ) -> list[Decision]:
        """Turn GPU counts into placements, keeping apps on the GPUs they had where possible."""
        placements: dict[str, dict[str, int]] = {}
        for job in apps:
            if held[job.job_id] > 0:
                placements[job.job_id] = dict(job.placement)
        # Apps whose lease expired keep as much of their old placement as they won back.
        for job in apps:
            if job.job_id in expired:
                kept = _shrink(job.placement, extra[job.job_id])
                for node, gpus in kept.items():
                    pool[node] -= gpus
                placements[job.job_id] = kept
                extra[job.job_id] -= sum(kept.values())
        # The rest of each grant by best fit on what is left of the pool.
        requests = {job_id: gpus for job_id, gpus in extra.items() if gpus > 0}
        by_id = {job.job_id: job for job in apps}

        def prefer(job_id: str, node: str) -> float:
            rank = self.preference(by_id[job_id].spec, state)
            return rank(node) if rank else 0.0

        granted = best_fit_many(pool, requests, prefer if self.locality else None)
        assert granted is not None, "grants never exceed the pool"
        for job_id, placement in granted.items():
            merged = placements.setdefault(job_id, {})
            for node, gpus in placement.items():
                merged[node] = merged.get(node, 0) + gpus

        decisions: list[Decision] = []
        for job in apps:
            placement = {n: g for n, g in placements.get(job.job_id, {}).items() if g > 0}
            granted_now = job.job_id in expired or job.job_id in requests
            if granted_now and placement:
                self._lease_ends[job.job_id] = state.now + self.lease_s
            if not job.placement:
                if placement:
                    decisions.append(Start(job.job_id, placement, "won in the Themis auction"))
                else:
                    decisions.append(Wait(job.job_id, "not granted GPUs this round"))
            elif placement != dict(job.placement):
                if not placement:
                    self._lease_ends.pop(job.job_id, None)
                decisions.append(Resize(job.job_id, placement, "lease renewed with new GPUs"))
        return decisions

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        """For one job: a compact (best-fit) placement of the GPUs it asks for."""
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = best_fit(free, job.gpus, prefer)
        if placement is None:
            return None
        apps = len(state.running) + len(state.waiting) + 1
        rho = self.rho(JobState(job), job.gpus, state, apps)
        score = prefer or (lambda node: -free[node])
        return PlacementChoice(
            placement, ranking(job, state, score, free), f"compact placement, estimated ρ {rho:.2f}"
        )


def _shrink(placement: Mapping[str, int], gpus: int) -> dict[str, int]:
    """Keep ``gpus`` of a placement, dropping GPUs from the nodes where it has fewest first."""
    kept: dict[str, int] = {}
    for node in sorted(placement, key=lambda n: (-placement[n], n)):
        take = min(placement[node], gpus - sum(kept.values()))
        if take > 0:
            kept[node] = take
    return kept


# --- Tiresias-like LAS -------------------------------------------------------------------------


class LasPolicy(Policy):
    """Tiresias' discretised 2D least-attained-service scheduler (the P5 comparison)."""

    base_name = "tiresias-las"

    def __init__(
        self, *, locality: bool = False, thresholds_gpu_s: Sequence[float] = (3600.0, 36000.0)
    ) -> None:
        super().__init__(locality=locality)
        self.thresholds = tuple(sorted(thresholds_gpu_s))

    def _queue(self, job: JobState) -> int:
        return sum(1 for limit in self.thresholds if job.attained_gpu_s >= limit)

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = first_fit(free, job.gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda node: float(free[node]))
        return PlacementChoice(placement, ranking(job, state, score, free), "consolidated")

    def schedule(self, state: ClusterState) -> list[Decision]:
        jobs = sorted(
            (*state.running, *state.waiting),
            key=lambda j: (self._queue(j), j.spec.arrival, j.job_id),
        )
        room = state.total_gpus
        chosen = set()
        for job in jobs:
            if job.spec.gpus <= room:
                chosen.add(job.job_id)
                room -= job.spec.gpus
        free = state.free_gpus()
        decisions: list[Decision] = []
        for job in state.running:
            if job.job_id not in chosen:
                for node, gpus in job.placement.items():
                    free[node] += gpus
                decisions.append(Resize(job.job_id, {}, "preempted by less-attained jobs"))
        for job in jobs:
            if job.placement or job.job_id not in chosen:
                if not job.placement:
                    decisions.append(Wait(job.job_id, "lower LAS priority"))
                continue
            choice = self.place(job.spec, with_free(state, free))
            if choice is None:
                decisions.append(Wait(job.job_id, "its GPUs are fragmented across nodes"))
                continue
            for node, gpus in choice.placement.items():
                free[node] -= gpus
            decisions.append(Start(job.job_id, choice.placement, f"LAS queue {self._queue(job)}"))
        return decisions

    def next_wakeup(self, state: ClusterState) -> float | None:
        """When the next running job crosses a queue threshold (its priority drops)."""
        times = [
            state.now + (limit - job.attained_gpu_s) / job.gpus_held
            for job in state.running
            for limit in self.thresholds
            if job.attained_gpu_s < limit and job.gpus_held > 0
        ]
        return min(times) if times else None
