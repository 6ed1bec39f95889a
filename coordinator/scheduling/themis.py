"""P5: Themis (finish-time fair auctions over leases) and its least-attained-service baselines.

Terms (the paper, "Терминология"): an *app* is one or more training jobs of one user for one
goal (a hyper-parameter search is one app of many jobs); a *job* is a set of parallel tasks
that process each mini-batch together, so it runs gang-scheduled on exactly the GPUs it asks
for. ``JobSpec.app`` names a job's app (``None``: the job is an app of its own).

Finish-time fairness (the paper, "Мотивация"): ρ = T_sh / T_id, T_sh = the app's finish time
in the shared cluster (from its arrival), T_id = its finish time alone on a private 1/N share
of the cluster, N = the apps contending. Themis' goal is to minimise the largest ρ.

T_id needs a model of how an app runs alone on S GPUs; the paper gives none. Ours is the
*fluid* finish time :func:`fluid_finish_seconds`: with job j taking t_j seconds on its d_j GPUs
(compactly placed), ``T(S) = max(max_j t_j·max(1, d_j/S), Σ_j t_j·d_j / S)`` — no job can
finish faster than alone on its own GPUs (time-sliced when S < d_j), and the app's GPU-seconds
need S GPUs for Σ t_j·d_j / S. It is the ideal (a lower bound on any real schedule on S GPUs).

Themis round (at every arrival, completion and lease expiry). The paper's summary describes the
two levels, the bids and the auction; the fairness knob f, the partial-allocation (PA) auction
and the leftover step are from its reference [1] (Themis, NSDI 2020), which it summarises:

1. The pool: idle GPUs and the GPUs of jobs whose lease expired (such a job holds nothing until
   its app wins GPUs for it again).
2. The pool is offered to the ``ceil((1 − f)·N)`` apps with the worst ρ (:func:`offered_count`)
   among the apps with a job the pool can hold.
3. Each offered app's agent bids 1/ρ for every number k of extra GPUs: it packs whole waiting
   jobs of the app into k GPUs (:func:`pack_jobs`, in its own order: least attained service
   first, as a hyper-parameter tuner runs every trial's first stage before promoting any), and
   estimates ρ with its profile (fluid remaining time on the GPUs it would then hold), each
   packed job at the speed of the placement it would get from the pool (the paper: bids
   capture placement sensitivity; ``placement_aware=False`` counts every job as packed).
   Zero extra GPUs for an app holding none is valued as "wait one lease, then run on a fair
   1/N share", so every bid is finite.
4. PA (:func:`partial_allocation`): the allocation maximising Π 1/ρ (Nash social welfare; a
   grouped knapsack in log space); each winner keeps the fraction
   c_i = Π_{j≠i} V_j(A) / Π_{j≠i} V_j(A_-i) of what it won (rounded to the nearest GPU), the
   hidden payment for the harm it does to the others; its agent packs whole jobs into them.
5. Leftovers (withheld, unpacked or unoffered GPUs) go round-robin, one whole job at a time, to
   the apps outside the auction, worst ρ first, then to the bidders (work conserving).
6. Every job granted GPUs holds them for a lease of ``lease_s``; a job whose lease expires and
   whose app wins it again keeps its GPUs (no restart), unless it holds more or fewer than its
   demand (a queue from ``POST /v1/schedule`` may list such a job): it is resized to its demand.

"+locality": remaining time includes the I/O stall and placements prefer cached nodes.

Baselines:
- :class:`LeasedLasPolicy`, LAS as the paper defines it (its note on LAS, after the
  references): GPUs are leased for a term, and when a lease expires the available GPUs go to
  the *job* that has received the least GPU time; each job gang-scheduled on its demand.
- :class:`LasPolicy`, Tiresias' discretised 2D-LAS: queues by attained GPU-seconds, FIFO
  within a queue, preemptive at every event, gang-scheduled, consolidated placement.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
from .placement import best_fit, best_fit_many, first_fit, random_fit
from .policy import Policy, candidate_free, ranking, with_free


def finish_time_fairness(shared_s: float, independent_s: float) -> float:
    """ρ = T_shared / T_independent."""
    return shared_s / independent_s


@dataclass(frozen=True)
class FluidWork:
    """Jobs reduced to what their fluid finish time needs: the GPU-seconds, and per GPU count
    the longest job asking for it."""

    gpu_seconds: float
    longest_by_gpus: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, jobs: Iterable[tuple[float, int]]) -> FluidWork:
        longest: dict[int, float] = {}
        gpu_seconds = 0.0
        for seconds, demand in jobs:
            longest[demand] = max(longest.get(demand, 0.0), seconds)
            gpu_seconds += seconds * demand
        return cls(gpu_seconds, tuple(sorted(longest.items())))

    def slowed(self, jobs: Iterable[tuple[float, float, int]]) -> FluidWork:
        """The same work with some jobs slower: (seconds before, seconds now, GPUs) each."""
        longest = dict(self.longest_by_gpus)
        gpu_seconds = self.gpu_seconds
        for before, now, demand in jobs:
            gpu_seconds += (now - before) * demand
            longest[demand] = max(longest.get(demand, 0.0), now)
        return FluidWork(gpu_seconds, tuple(sorted(longest.items())))

    def seconds(self, gpus: float) -> float:
        """``max(max_j t_j·max(1, d_j/gpus), Σ_j t_j·d_j / gpus)``; 0 for no jobs, inf on no
        GPUs."""
        if not self.longest_by_gpus:
            return 0.0
        if gpus <= 0:
            return math.inf
        slowest = max(t * max(1.0, d / gpus) for d, t in self.longest_by_gpus)
        return max(slowest, self.gpu_seconds / gpus)


def fluid_finish_seconds(jobs: Iterable[tuple[float, int]], gpus: float) -> float:
    """The fluid finish time of ``jobs`` = (seconds on its own GPUs, its GPUs) on ``gpus`` GPUs:
    ``max(max_j t_j·max(1, d_j/gpus), Σ_j t_j·d_j / gpus)``; 0 for no jobs, inf on no GPUs."""
    return FluidWork.of(jobs).seconds(gpus)


def app_independent_seconds(
    jobs: Iterable[tuple[float, int]], total_gpus: int, apps: float
) -> float:
    """T_id of an app: the fluid finish time of all its jobs on a 1/``apps`` share."""
    return fluid_finish_seconds(jobs, total_gpus / max(apps, 1.0))


def independent_seconds(
    spec: JobSpec,
    total_gpus: int,
    apps: float,
    per_node: int,
    rate_of: Callable[[JobSpec, Placement], float] = estimated_rate,
) -> float:
    """T_independent of one job for the simulator's per-job ρ: the job alone on a 1/``apps``
    share of the cluster at up to ``gpu_cap`` GPUs, compactly placed (a share below one GPU is
    a time-slice of it). ``rate_of`` predicts samples/s: the profile here, the truth in the
    simulator. P5's app-level ρ uses :func:`app_independent_seconds` instead."""
    share = total_gpus / max(apps, 1.0)
    gpus = max(1, min(spec.gpu_cap, int(share)))
    rate = rate_of(spec, packed_shape(gpus, per_node))
    if share < 1:
        rate *= share
    return spec.samples / rate


def offered_count(apps: int, fairness_knob: float) -> int:
    """How many apps see an offer: the ``1 − f`` fraction with the worst ρ, at least one."""
    return max(1, math.ceil((1.0 - fairness_knob) * apps - 1e-9))


def pack_jobs(demands: Sequence[int], gpus: int) -> list[int]:
    """Which jobs an agent starts on ``gpus`` extra GPUs: in its order, every job that still
    fits whole (gang scheduling). Returns their indices."""
    chosen, left = [], gpus
    for index, demand in enumerate(demands):
        if demand <= left:
            chosen.append(index)
            left -= demand
    return chosen


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


# --- leases ------------------------------------------------------------------------------------


def _intra_app_order(job: JobState) -> tuple[float, float, str]:
    """Least attained GPU-seconds first (breadth-first over a search's trials), then arrival."""
    return (job.attained_gpu_s, job.spec.arrival, job.job_id)


@dataclass
class _Round:
    """One round's view of the leases: who keeps GPUs, what is in the pool, who is pending."""

    expired: set[str]
    pool: dict[str, int]
    #: jobs holding no GPUs after the expiries (waiting or lease expired).
    pending: list[JobState] = field(default_factory=list)


class _LeasedPolicy(Policy):
    """Lease bookkeeping and grant placement shared by Themis and the paper's LAS."""

    def __init__(self, *, locality: bool, lease_s: float) -> None:
        super().__init__(locality=locality)
        if lease_s <= 0:
            raise SchedulingError(f"lease_s={lease_s} must be positive")
        self.lease_s = lease_s
        self._lease_ends: dict[str, float] = {}
        #: Set: grants go to free GPUs in a random (seeded) node order instead of best fit.
        self._rng: random.Random | None = None

    def next_wakeup(self, state: ClusterState) -> float | None:
        ends = [self._lease_ends.get(job.job_id, state.now) for job in state.running]
        later = [end for end in ends if end > state.now]
        return min(later) if later else None

    def _open_round(self, state: ClusterState) -> _Round:
        running_ids = {job.job_id for job in state.running}
        self._lease_ends = {j: end for j, end in self._lease_ends.items() if j in running_ids}
        expired = {
            job.job_id
            for job in state.running
            if self._lease_ends.get(job.job_id, state.now) <= state.now
        }
        pool = state.free_gpus()
        for job in state.running:
            if job.job_id in expired:
                for node, gpus in job.placement.items():
                    pool[node] += gpus
        pending = [j for j in state.running if j.job_id in expired] + list(state.waiting)
        return _Round(expired, pool, pending)

    def _decide(
        self, state: ClusterState, round_: _Round, granted: Iterable[JobState], why: str
    ) -> list[Decision]:
        """Place the ``granted`` jobs (each on exactly its demand) and lease their GPUs."""
        pool = dict(round_.pool)
        granted_ids = {job.job_id for job in granted}
        # A job whose lease expired and that won again keeps its GPUs (no restart) when it
        # holds its demand. One holding more or fewer (an elastic job another scheduler sized,
        # as a queue sent to POST /v1/schedule may list) is placed anew on its demand: the
        # round granted it its demand, and kept GPUs beyond that would overfill the pool.
        keeps = {
            job.job_id
            for job in state.running
            if job.job_id in round_.expired
            and job.job_id in granted_ids
            and job.gpus_held == job.spec.gpus
        }
        for job in state.running:
            if job.job_id in keeps:
                for node, gpus in job.placement.items():
                    pool[node] -= gpus
        by_id = {job.job_id: job for job in round_.pending}
        requests = {
            job_id: by_id[job_id].spec.gpus for job_id in sorted(granted_ids) if job_id not in keeps
        }

        def prefer(job_id: str, node: str) -> float:
            rank = self.preference(by_id[job_id].spec, state)
            return rank(node) if rank else 0.0

        placements = self._place_grants(pool, requests, prefer if self.locality else None)
        if placements is None:
            raise SchedulingError("grants exceed the pool: a policy bug")
        decisions: list[Decision] = []
        for job in round_.pending:
            if job.job_id in granted_ids:
                self._lease_ends[job.job_id] = state.now + self.lease_s
                if not job.placement:
                    decisions.append(Start(job.job_id, placements[job.job_id], why))
                elif job.job_id not in keeps:
                    reason = f"{why}; resized from {job.gpus_held} to its {job.spec.gpus} GPUs"
                    decisions.append(Resize(job.job_id, placements[job.job_id], reason))
            elif job.placement:
                self._lease_ends.pop(job.job_id, None)
                decisions.append(Resize(job.job_id, {}, "lease expired; GPUs went to others"))
            else:
                decisions.append(Wait(job.job_id, "not granted GPUs this round"))
        return decisions

    def _place_grants(
        self,
        pool: Mapping[str, int],
        requests: Mapping[str, int],
        prefer: Callable[[str, str], float] | None,
    ) -> dict[str, dict[str, int]] | None:
        """Where the granted jobs go: best fit, largest first (compact placements); with
        ``_rng``, each job in turn (by id) on nodes in a random order, blind to placement."""
        if self._rng is None:
            return best_fit_many(pool, requests, prefer)
        left = dict(pool)
        placements = {}
        for job_id in sorted(requests):
            placement = random_fit(left, requests[job_id], self._rng)
            if placement is None:
                return None
            for node, gpus in placement.items():
                left[node] -= gpus
            placements[job_id] = placement
        return placements

    def _compact_place(self, job: JobSpec, state: ClusterState, why: str) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = best_fit(free, job.gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda node: -free[node])
        return PlacementChoice(placement, ranking(job, state, score, free), why)


# --- Themis ------------------------------------------------------------------------------------


@dataclass
class _AppBook:
    """What the arbiter remembers of an app: its arrival and every job it has seen, as
    (estimated seconds on the job's own GPUs, its GPUs), for the app's T_id."""

    arrival: float
    jobs: dict[str, tuple[float, int]] = field(default_factory=dict)
    #: ``FluidWork`` of ``jobs`` (None: recompute, a job was added).
    work: FluidWork | None = None

    def independent_seconds(self, total_gpus: int, apps: int) -> float:
        if self.work is None:
            self.work = FluidWork.of(self.jobs.values())
        return self.work.seconds(total_gpus / max(apps, 1))


class ThemisPolicy(_LeasedPolicy):
    """P5's arbiter: rounds, bids of whole jobs per app, partial-allocation auction, leases."""

    base_name = "p5-themis"
    honours_candidates = False

    def __init__(
        self,
        *,
        locality: bool = False,
        fairness_knob: float = 0.8,
        lease_s: float = 1200.0,
        placement_aware: bool = True,
        hold_for_worst: bool = False,
    ) -> None:
        super().__init__(locality=locality, lease_s=lease_s)
        if not 0.0 <= fairness_knob < 1.0:
            raise SchedulingError(f"fairness knob f={fairness_knob} must lie in [0, 1)")
        self.fairness_knob = fairness_knob
        self.placement_aware = placement_aware
        #: ours, not the paper's: while the app with the worst ρ cannot fit its next job in
        #: the pool, keep the pool idle for it (no auction, no leftovers) so wide gangs are
        #: not starved by piecemeal pools.
        self.hold_for_worst = hold_for_worst
        #: app -> its bid (1/ρ for 0, 1, ... extra GPUs) in the last round, for explanations.
        self.last_bids: dict[str, list[float]] = {}
        self._apps: dict[str, _AppBook] = {}
        self._rates: dict[str, float] = {}

    # --- ρ estimates -----------------------------------------------------------------------

    def _packed_rate(self, spec: JobSpec, state: ClusterState) -> float:
        """The profile's samples/s of ``spec`` on its GPUs, compactly placed (a job's spec and
        the cluster's node size do not change, so it is computed once per job)."""
        rate = self._rates.get(spec.job_id)
        if rate is None:
            per_node = max(node.gpus for node in state.nodes.values())
            rate = self._rates[spec.job_id] = estimated_rate(
                spec, packed_shape(spec.gpus, per_node)
            )
        return rate

    def job_seconds(self, job: JobState, state: ClusterState, *, whole: bool = False) -> float:
        """The agent's estimate of the job's remaining (or ``whole``) time on its own GPUs,
        compactly placed."""
        samples = job.spec.samples if whole else job.remaining_samples
        rate = self._packed_rate(job.spec, state)
        if rate <= 0:
            return math.inf
        compute = samples / rate
        if not self.locality:
            return compute
        return with_io(compute, self.io_seconds_on(job.spec, job.spec.gpus, state, samples))

    def _remember(self, apps: Mapping[str, list[JobState]], state: ClusterState) -> None:
        """Record each app's jobs the first time they are seen; forget apps that are gone."""
        self._apps = {app: book for app, book in self._apps.items() if app in apps}
        live = {job.job_id for jobs in apps.values() for job in jobs}
        self._rates = {job_id: rate for job_id, rate in self._rates.items() if job_id in live}
        for app, jobs in apps.items():
            book = self._apps.setdefault(app, _AppBook(min(j.spec.arrival for j in jobs)))
            book.arrival = min(book.arrival, *(j.spec.arrival for j in jobs))
            for job in jobs:
                if job.job_id not in book.jobs:
                    book.jobs[job.job_id] = (
                        self.job_seconds(job, state, whole=True),
                        job.spec.gpus,
                    )
                    book.work = None

    def app_rho(
        self,
        app: str,
        remaining: FluidWork,
        gpus: int,
        state: ClusterState,
        apps: int,
        independent: float | None = None,
    ) -> float:
        """ρ of ``app`` if it holds ``gpus`` GPUs from now on, its ``remaining`` jobs given as
        their fluid work (seconds left on own GPUs, GPUs). With 0 GPUs it waits a lease, then
        runs on its fair 1/N share. ``independent``: the app's T_id if known this round."""
        book = self._apps[app]
        fair = state.total_gpus / max(apps, 1)
        # Holding nothing, the app waits (at least) a lease for the next round.
        left = remaining.seconds(gpus) if gpus > 0 else self.lease_s + remaining.seconds(fair)
        shared = state.now - book.arrival + left
        if independent is None:
            independent = book.independent_seconds(state.total_gpus, apps)
        return finish_time_fairness(shared, independent)

    # --- one round -------------------------------------------------------------------------

    def schedule(self, state: ClusterState) -> list[Decision]:
        by_app: dict[str, list[JobState]] = {}
        for job in (*state.running, *state.waiting):
            by_app.setdefault(job.spec.app_id, []).append(job)
        self._remember(by_app, state)
        round_ = self._open_round(state)
        count = len(by_app)
        capacity = sum(round_.pool.values())

        held: dict[str, int] = dict.fromkeys(by_app, 0)
        pending: dict[str, list[JobState]] = {app: [] for app in by_app}
        remaining: dict[str, FluidWork] = {}
        for app, jobs in by_app.items():
            remaining[app] = FluidWork.of((self.job_seconds(j, state), j.spec.gpus) for j in jobs)
            for job in jobs:
                if job.placement and job.job_id not in round_.expired:
                    held[app] += job.gpus_held
                else:
                    pending[app].append(job)
            pending[app].sort(key=_intra_app_order)

        independent = {
            app: self._apps[app].independent_seconds(state.total_gpus, count) for app in by_app
        }

        def rho(app: str, gpus: int, work: FluidWork | None = None) -> float:
            left = remaining[app] if work is None else work
            return self.app_rho(app, left, gpus, state, count, independent[app])

        now_rho = {app: rho(app, held[app]) for app in by_app}
        if self.hold_for_worst and self._worst_cannot_fit(pending, now_rho, capacity):
            return self._decide(state, round_, [], "GPUs held for the app furthest behind")
        wanting = [app for app in by_app if any(job.spec.gpus <= capacity for job in pending[app])]
        wanting.sort(key=lambda app: (-now_rho[app], app))
        offered = wanting[: offered_count(count, self.fairness_knob)]

        granted: dict[str, list[JobState]] = {app: [] for app in by_app}
        self.last_bids = {}
        if offered and capacity > 0:
            bids = {
                app: self._bid(pending[app], held[app], round_.pool, remaining[app], rho)
                for app in offered
            }
            self.last_bids = bids
            result = partial_allocation(bids, capacity)
            for app in offered:
                demands = [job.spec.gpus for job in pending[app]]
                chosen = [pending[app][i] for i in pack_jobs(demands, result.kept[app])]
                granted[app].extend(chosen)
                capacity -= sum(job.spec.gpus for job in chosen)
        # Leftovers: one whole job per app per pass, outside the auction first, worst ρ first.
        in_auction = set(offered)
        order = sorted(wanting, key=lambda app: (app in in_auction, -now_rho[app], app))
        progress = True
        while progress and capacity > 0:
            progress = False
            for app in order:
                given = {job.job_id for job in granted[app]}
                fitting = [
                    job
                    for job in pending[app]
                    if job.job_id not in given and job.spec.gpus <= capacity
                ]
                if fitting:
                    granted[app].append(fitting[0])
                    capacity -= fitting[0].spec.gpus
                    progress = True
        chosen_jobs = [job for jobs in granted.values() for job in jobs]
        return self._decide(state, round_, chosen_jobs, "won GPUs in the Themis round")

    @staticmethod
    def _worst_cannot_fit(
        pending: Mapping[str, list[JobState]], rho: Mapping[str, float], capacity: int
    ) -> bool:
        """Whether the worst-ρ app with a waiting job has none that fits ``capacity`` GPUs."""
        waiting = [app for app in pending if pending[app]]
        if not waiting:
            return False
        worst = max(waiting, key=lambda app: (rho[app], app))
        return min(job.spec.gpus for job in pending[worst]) > capacity

    def _bid(
        self,
        pending: Sequence[JobState],
        held: int,
        pool: Mapping[str, int],
        work: FluidWork,
        rho: Callable[[str, int, FluidWork | None], float],
    ) -> list[float]:
        """1/ρ for k = 0..capacity extra GPUs of the ``pool``, each k holding the whole jobs the
        agent packs. With ``placement_aware`` bids the packed jobs' times are those of the
        placements they would get from the pool (a job spread over nodes is slower: the
        placement sensitivity the bids capture); otherwise every job counts as packed."""
        demands = [job.spec.gpus for job in pending]
        app = pending[0].spec.app_id
        by_usable: dict[tuple[int, ...], float] = {}
        values = []
        for extra in range(min(sum(pool.values()), sum(demands)) + 1):
            packed = tuple(pack_jobs(demands, extra))
            if packed not in by_usable:
                usable = sum(demands[i] for i in packed)
                slowed = self._placed_work(work, [pending[i] for i in packed], pool)
                by_usable[packed] = 1.0 / rho(app, held + usable, slowed)
            values.append(by_usable[packed])
        return values

    def _placed_work(
        self, work: FluidWork, jobs: Sequence[JobState], pool: Mapping[str, int]
    ) -> FluidWork | None:
        """``work`` with ``jobs`` at the speed of their best-fit placements on ``pool``."""
        if not self.placement_aware or not jobs:
            return None
        placements = best_fit_many(pool, {job.job_id: job.spec.gpus for job in jobs})
        if placements is None:
            return None
        slower = []
        for job in jobs:
            packed_rate = self._rates[job.job_id]
            placed_rate = estimated_rate(job.spec, placements[job.job_id])
            if placed_rate < packed_rate:
                before = job.remaining_samples / packed_rate
                now = job.remaining_samples / placed_rate if placed_rate > 0 else math.inf
                slower.append((before, now, job.spec.gpus))
        return work.slowed(slower) if slower else None

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        """For one job: a compact (best-fit) placement of the GPUs it asks for."""
        apps = len({j.spec.app_id for j in (*state.running, *state.waiting)} | {job.app_id}) or 1
        view = JobState(job)
        seconds = self.job_seconds(view, state, whole=True)
        shared = max(0.0, state.now - job.arrival) + seconds
        independent = app_independent_seconds([(seconds, job.gpus)], state.total_gpus, apps)
        rho = finish_time_fairness(shared, independent)
        return self._compact_place(job, state, f"compact placement, estimated ρ {rho:.2f}")


# --- the paper's LAS: leases, least attained service per job ------------------------------------


class LeasedLasPolicy(_LeasedPolicy):
    """LAS as the paper defines it: leased GPUs; on expiry (and whenever GPUs are idle) the
    available GPUs go to the jobs with the least attained GPU time, each on its whole demand."""

    base_name = "las-leases"

    def __init__(
        self, *, locality: bool = False, lease_s: float = 1200.0, random_seed: int | None = None
    ) -> None:
        """``random_seed``: place jobs on free GPUs in a random (seeded) node order, blind to
        placement, instead of best fit."""
        super().__init__(locality=locality, lease_s=lease_s)
        self._rng = None if random_seed is None else random.Random(random_seed)

    def schedule(self, state: ClusterState) -> list[Decision]:
        round_ = self._open_round(state)
        capacity = sum(round_.pool.values())
        granted = []
        for job in sorted(round_.pending, key=_intra_app_order):
            if job.spec.gpus <= capacity:
                granted.append(job)
                capacity -= job.spec.gpus
        return self._decide(state, round_, granted, "least attained GPU time")

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        return self._compact_place(job, state, "consolidated")


# --- Tiresias-like LAS -------------------------------------------------------------------------


class LasPolicy(Policy):
    """Tiresias' discretised 2D least-attained-service scheduler."""

    base_name = "tiresias-las"

    def __init__(
        self, *, locality: bool = False, thresholds_gpu_s: Sequence[float] = (3600.0, 36000.0)
    ) -> None:
        super().__init__(locality=locality)
        self.thresholds = tuple(sorted(thresholds_gpu_s))

    def _queue(self, job: JobState) -> int:
        return sum(1 for limit in self.thresholds if job.attained_gpu_s >= limit)

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        fitted = self.fit_and_rank(job, state, first_fit, lambda free, node: float(free[node]))
        return PlacementChoice(*fitted, "consolidated") if fitted is not None else None

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
