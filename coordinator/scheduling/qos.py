"""P3: QoS-aware dynamic scheduling for a shared GPU cluster, and its six baselines.

Model (see :mod:`.perf`): L(t, s) = samples / PR(t, s) + v, equation (4), with
PR = (d_node·d_g − Comm(s))·sPR, equation (5); sPR is a quadratic in the local batch, equation
(7) (fitted by :func:`fit_quadratic_throughput`), and γ, λ of Comm are regressed from profiled
runs (:func:`fit_comm_penalty`).

Expected completion time, equation (9), as an absolute time e = arrival + ECT: Urgent ECT = 0
(so e = arrival, which no placement meets: the paper, section 3.3, "其用戶QoS一定會被違反"),
Prior = ``prior_multiple`` × L(t, ⟨1,1⟩) and Normal = 2 × L(t, ⟨1,1⟩). The paper's text fixes
Normal only; equation (9) is an image missing from it, so the Prior multiple is ours (1x).

Cost of a placement, equation (10) (an image; the text says its first term is the share of the
cluster's GPUs used and its second the topology, balanced by θ): GPUs used / cluster GPUs + θ ·
nodes spanned / cluster nodes. CER, equation (11) (an image; "based on equations (5) and
(10)"): PR / cost.

At every arrival or completion (section 3.4): every waiting task's placement set M_i is every
symmetric ⟨d_node, d_g⟩ of the cluster (d_node ≤ N nodes, d_g ≤ G GPUs of a node, at most the
task's ``max_gpus``), whatever is free now; of those meeting now + L ≤ e, equation (15), the
task takes the highest-CER one, else the highest-CER one of M_i; its slack is
w = e − (L + now), equation (16). Tasks are dispatched in order of smallest slack "until the
current resources cannot satisfy" the next one: the first task whose placement does not fit the
free GPUs stops the dispatch. ``backfill=True`` is our variant, not the paper's: such a task is
re-planned on the free GPUs and the dispatch goes on.

"+locality": L includes the I/O stall (:mod:`.locality`) and, among nodes of equal shape, those
holding the job's data are chosen first.

Baselines, as the paper's section 4.1 defines them: FIFO (:mod:`.baselines`); Capacity (a
guaranteed share per task type, never exceeded, no borrowing); Min-Min (earliest expected
completion time first); Weighted Fair (smallest weighted arrival time and ECT first); Tetris +
Perf and Tetris + CER (each task's highest-PR or highest-CER placement, packed by Tetris).
FIFO, Capacity, Min-Min and Weighted Fair give a task the GPUs its user asked for.
"""

from __future__ import annotations

import bisect
import dataclasses
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .fitting import least_squares, nonnegative_least_squares
from .model import (
    ClusterState,
    Decision,
    JobSpec,
    JobState,
    Placement,
    PlacementChoice,
    QosClass,
    SchedulingError,
    Start,
    Wait,
)
from .perf import compute_seconds
from .placement import first_fit, nodes_spanned, place_shape, symmetric_shapes
from .policy import Policy, candidate_free, fifo_schedule, ranking, take

PRIOR_MULTIPLE = 1.0
NORMAL_MULTIPLE = 2.0
#: P3's θ of equation (10): the paper gives no value (ours; the P3 report sweeps it).
THETA = 0.5
#: Weighted Fair's weight of the arrival time against the ECT (ours; the paper gives none).
ARRIVAL_WEIGHT = 0.5
#: The Capacity scheduler's guaranteed shares when its queues are the QoS classes: the mix of
#: P3's workload, Urgent : Prior : Normal = 5 : 35 : 60 (ours: the paper names no shares).
QOS_SHARES: Mapping[str, float] = {
    QosClass.URGENT.value: 0.05,
    QosClass.PRIOR.value: 0.35,
    QosClass.NORMAL.value: 0.60,
}


# --- fitting (offline profiling) ---------------------------------------------------------------


def fit_quadratic_throughput(
    points: Sequence[tuple[float, float]], *, relative: bool = False
) -> tuple[float, float, float]:
    """Least-squares quadratic ``a + b·x + c·x²`` through (local batch, samples/s per GPU).

    ``relative`` minimises the relative errors (each point weighted by 1/y), the measure P3
    reports its prediction error in; otherwise the absolute ones."""
    if len({x for x, _ in points}) < 3:
        raise SchedulingError("a quadratic throughput fit needs at least 3 distinct batch sizes")
    if relative:
        rows = [(1.0 / y, x / y, x * x / y) for x, y in points]
        a, b, c = least_squares(rows, [1.0] * len(points))
    else:
        a, b, c = least_squares([(1.0, x, x * x) for x, _ in points], [y for _, y in points])
    return a, b, c


def comm_features(placement: Placement) -> tuple[float, float]:
    """(same-node peers, other-node peers) averaged over the placement's GPUs."""
    total = sum(placement.values())
    intra = sum(g * (g - 1) for g in placement.values()) / total
    inter = sum(g * (total - g) for g in placement.values()) / total
    return intra, inter


def fit_comm_penalty(samples: Sequence[tuple[Placement, float, float]]) -> tuple[float, float]:
    """γ, λ from profiled (placement, measured samples/s, single-GPU samples/s at that batch).

    Comm(s) = G − PR/sPR is linear in the placement's features: γ·intra + (γ·λ)·inter, fitted by
    non-negative least squares.
    """
    rows, lost = [], []
    for placement, measured, per_gpu in samples:
        if sum(placement.values()) > 1:
            rows.append(comm_features(placement))
            lost.append(sum(placement.values()) - measured / per_gpu)
    if len(rows) < 2:
        raise SchedulingError("fitting γ and λ needs at least 2 multi-GPU measurements")
    gamma, gamma_lambda = nonnegative_least_squares(rows, lost)
    if gamma <= 0:
        return 0.0, 1.0
    return float(gamma), float(gamma_lambda / gamma)


# --- ECT, cost, CER -------------------------------------------------------------------------


def single_gpu_seconds(spec: JobSpec) -> float:
    """L(t, ⟨1,1⟩), equation (4) on one GPU: the normalising time of ECTs and latencies."""
    return compute_seconds(spec, {"gpu": 1}, spec.samples)


def expected_completion(
    spec: JobSpec, prior_multiple: float = PRIOR_MULTIPLE, normal_multiple: float = NORMAL_MULTIPLE
) -> float:
    """P3's e = arrival + ECT. Urgent's ECT is 0: e is the arrival, which no task can meet."""
    if spec.qos is QosClass.URGENT:
        return spec.arrival
    multiple = prior_multiple if spec.qos is QosClass.PRIOR else normal_multiple
    return spec.arrival + multiple * single_gpu_seconds(spec)


def placement_cost(placement: Placement, state: ClusterState, theta: float) -> float:
    """Equation (10): fraction of the cluster's GPUs used + θ · fraction of its nodes spanned."""
    return sum(placement.values()) / state.total_gpus + theta * nodes_spanned(placement) / len(
        state.nodes
    )


@dataclass(frozen=True)
class Option:
    """One placement of a task: its shape, nodes, predicted time L, throughput PR and CER."""

    shape: tuple[int, int]
    placement: dict[str, int]
    seconds: float
    rate: float
    cer: float


class _ShapePlanner(Policy):
    """Shared by P3 and the Tetris baselines: symmetric shapes scored with P3's model."""

    def __init__(self, *, locality: bool = False, theta: float = THETA) -> None:
        super().__init__(locality=locality)
        self.theta = theta
        # Without "+locality" a shape's time and cost depend only on the shape, so they are
        # remembered per (job, samples left, shape, cluster size): queues are re-planned often.
        self._by_shape: dict[tuple[str, float, int, int, int, int], tuple[float, float, float]] = {}
        self._cluster_options: dict[tuple[str, float, int, int], list[Option]] = {}

    def options(
        self, job: JobState, state: ClusterState, gpus: Mapping[str, int] | None = None
    ) -> list[Option]:
        """Every symmetric placement of ``job`` on ``gpus`` (default: M_i, the whole cluster
        whatever is free) with its L, PR and CER."""
        spec = job.spec
        memo_key = self._memo_key(job, state, gpus)
        if memo_key is not None and memo_key in self._cluster_options:
            return self._cluster_options[memo_key]
        if gpus is None:
            gpus = {name: node.gpus for name, node in state.nodes.items()}
        room = candidate_free(spec, gpus)
        prefer = self.preference(spec, state)
        found = []
        for node_count, per_node in symmetric_shapes(room, spec.gpu_cap):
            placement = place_shape(room, node_count, per_node, prefer)
            if placement is None:
                continue
            seconds, rate, cost = self._scored(job, placement, state, node_count, per_node)
            if seconds == float("inf"):
                continue
            found.append(Option((node_count, per_node), placement, seconds, rate, rate / cost))
        if memo_key is not None:
            if len(self._cluster_options) > 65536:
                self._cluster_options.clear()
            self._cluster_options[memo_key] = found
        return found

    def _memo_key(
        self, job: JobState, state: ClusterState, gpus: Mapping[str, int] | None
    ) -> tuple[str, float, int, int] | None:
        """M_i on the whole cluster does not change while a task waits: it is remembered per
        task when nothing else (locality, a node selector) enters it."""
        if gpus is not None or self.locality or job.spec.candidates is not None:
            return None
        return (job.job_id, job.remaining_samples, state.total_gpus, len(state.nodes))

    def _scored(
        self,
        job: JobState,
        placement: dict[str, int],
        state: ClusterState,
        node_count: int,
        per_node: int,
    ) -> tuple[float, float, float]:
        """(L, PR, cost) of ``placement``; PR is the rate L implies, samples / (L − v)."""
        key = (
            job.job_id,
            job.remaining_samples,
            node_count,
            per_node,
            state.total_gpus,
            len(state.nodes),
        )
        if self.locality or key not in self._by_shape:
            samples = job.remaining_samples
            seconds = self.predicted_seconds(job.spec, placement, state, samples)
            working = seconds - job.spec.profile.startup_s
            rate = samples / working if working > 0 else float("inf")
            value = (seconds, rate, placement_cost(placement, state, self.theta))
            if self.locality:
                return value
            if len(self._by_shape) > 65536:
                self._by_shape.clear()
            self._by_shape[key] = value
        return self._by_shape[key]

    def fit_now(
        self, spec: JobSpec, state: ClusterState, option: Option, free: Mapping[str, int]
    ) -> dict[str, int] | None:
        """The option's shape on the free GPUs (tightest nodes; preferred ones first), or None."""
        return place_shape(candidate_free(spec, free), *option.shape, self.preference(spec, state))

    def _choice(self, job: JobSpec, state: ClusterState, best: Option, why: str) -> PlacementChoice:
        free = candidate_free(job, state.free_gpus())
        in_best = set(best.placement)
        prefer = self.preference(job, state) or (lambda _node: 0.0)

        def score(node: str) -> float:
            return (node in in_best) * 1e18 + prefer(node) * 1e3 - free[node]

        return PlacementChoice(best.placement, ranking(job, state, score, free), why, best.seconds)


@dataclass(frozen=True)
class _Ranked:
    """A task's e and its options by time, to find the highest-CER one with L ≤ a budget fast
    (the same option as ``max`` over the list in its order: ties go to the earlier one)."""

    ect: float
    #: options sorted by L, with ``best_upto[k]`` the best of the first k + 1 of them.
    seconds: tuple[float, ...]
    best_upto: tuple[Option, ...]
    best: Option

    @staticmethod
    def of(ect: float, options: Sequence[Option]) -> _Ranked:
        order = sorted(range(len(options)), key=lambda i: options[i].seconds)
        best_upto: list[Option] = []
        best_index = -1
        for index in order:
            if best_index < 0 or _better(options[index], index, options[best_index], best_index):
                best_index = index
            best_upto.append(options[best_index])
        overall = max(options, key=lambda o: o.cer)
        seconds = tuple(options[i].seconds for i in order)
        return _Ranked(ect, seconds, tuple(best_upto), overall)

    def best_meeting(self, budget: float) -> Option:
        """The highest-CER option with L ≤ ``budget``, else the highest-CER one."""
        count = bisect.bisect_right(self.seconds, budget)
        return self.best_upto[count - 1] if count else self.best


def _better(option: Option, index: int, than: Option, than_index: int) -> bool:
    return option.cer > than.cer or (option.cer == than.cer and index < than_index)


class QosPolicy(_ShapePlanner):
    """P3: ECT-feasible placements, highest CER, smallest slack first, dispatched in order."""

    base_name = "p3-qos"

    def __init__(
        self,
        *,
        locality: bool = False,
        theta: float = THETA,
        prior_multiple: float = PRIOR_MULTIPLE,
        normal_multiple: float = NORMAL_MULTIPLE,
        backfill: bool = False,
    ) -> None:
        super().__init__(locality=locality, theta=theta)
        self.prior_multiple = prior_multiple
        self.normal_multiple = normal_multiple
        self.backfill = backfill
        self._ranked: dict[tuple[str, float, int, int], _Ranked] = {}

    def plan(
        self, job: JobState, state: ClusterState, gpus: Mapping[str, int] | None = None
    ) -> tuple[float, Option] | None:
        """(slack w, chosen option) of one task over M_i (or ``gpus``); None if it has none.

        The highest-CER option meeting now + L ≤ e (equation (15)), else the highest-CER one;
        w = e − (L + now) (equation (16)), negative when the ECT cannot be met."""
        key = self._memo_key(job, state, gpus)
        ranked = self._ranked.get(key) if key is not None else None
        if ranked is None:
            options = self.options(job, state, gpus)
            if not options:
                return None
            ect = expected_completion(job.spec, self.prior_multiple, self.normal_multiple)
            ranked = _Ranked.of(ect, options)
            if key is not None:
                if len(self._ranked) > 65536:
                    self._ranked.clear()
                self._ranked[key] = ranked
        best = ranked.best_meeting(ranked.ect - state.now)
        return ranked.ect - (state.now + best.seconds), best

    def schedule(self, state: ClusterState) -> list[Decision]:
        free = state.free_gpus()
        planned = []
        for job in state.waiting:
            plan = self.plan(job, state)
            if plan is not None:
                planned.append((plan[0], job.spec.arrival, job, plan[1]))
        planned.sort(key=lambda row: (row[0], row[1], row[2].job_id))

        decisions: list[Decision] = []
        started = set()
        stopped = False
        for slack, _arrival, job, option in planned:
            placement = self.fit_now(job.spec, state, option, free)
            if placement is None and self.backfill:
                replanned = self.plan(job, state, free)
                placement = replanned[1].placement if replanned else None
            if placement is None:
                if self.backfill:
                    continue
                stopped = True  # "until the current resources cannot satisfy" this task
                break
            take(free, placement)
            started.add(job.job_id)
            decisions.append(
                Start(
                    job.job_id,
                    placement,
                    f"slack {slack:.0f} s, ⟨{option.shape[0]},{option.shape[1]}⟩, "
                    f"CER {option.cer:.3g}",
                )
            )
        why = (
            "behind a task whose placement does not fit, in slack order"
            if stopped
            else "no placement fits the free GPUs"
        )
        decisions += [Wait(job.job_id, why) for job in state.waiting if job.job_id not in started]
        return decisions

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        plan = self.plan(JobState(job), state)
        if plan is None:
            return None
        slack, best = plan
        placement = self.fit_now(job, state, best, state.free_gpus())
        if placement is None:
            return None
        why = (
            "urgent: highest CER placement"
            if job.qos is QosClass.URGENT
            else f"highest CER placement meeting the ECT if any (slack {slack:.0f} s)"
        )
        return self._choice(job, state, dataclasses.replace(best, placement=placement), why)


# --- baselines --------------------------------------------------------------------------------


class _OrderedQueuePolicy(Policy):
    """The queue in the order of ``_key``; each task gets the GPUs its user asked for, first
    fit; the first task that does not fit stops the dispatch (as P3's own dispatch does)."""

    @abstractmethod
    def _key(self, spec: JobSpec) -> float:
        """Lower is served first."""

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        fitted = self.fit_and_rank(job, state, first_fit, lambda free, node: 0.0)
        if fitted is None:
            return None
        key = self._key(job)
        return PlacementChoice(*fitted, f"{self.base_name}: {job.gpus} GPUs asked (key {key:.0f})")

    def schedule(self, state: ClusterState) -> list[Decision]:
        queue = sorted(state.waiting, key=lambda j: (self._key(j.spec), j.spec.arrival, j.job_id))
        return fifo_schedule(self, state, queue)


class MinMinPolicy(_OrderedQueuePolicy):
    """P3's Min-Min baseline: the earlier a task's expected completion time, the earlier it
    runs (the paper's section 4.1, baseline (3))."""

    base_name = "min-min"

    def __init__(self, *, locality: bool = False, prior_multiple: float = PRIOR_MULTIPLE) -> None:
        super().__init__(locality=locality)
        self.prior_multiple = prior_multiple

    def _key(self, spec: JobSpec) -> float:
        return expected_completion(spec, self.prior_multiple)


class WeightedFairPolicy(_OrderedQueuePolicy):
    """P3's Weighted Fair baseline: order by a weighted value of the arrival time and the
    expected completion time, smaller first (baseline (4)):
    ``arrival_weight · arrival + (1 − arrival_weight) · e``."""

    base_name = "weighted-fair"

    def __init__(
        self,
        *,
        locality: bool = False,
        arrival_weight: float = ARRIVAL_WEIGHT,
        prior_multiple: float = PRIOR_MULTIPLE,
    ) -> None:
        super().__init__(locality=locality)
        if not 0.0 <= arrival_weight <= 1.0:
            raise SchedulingError(f"arrival_weight {arrival_weight} is not in [0, 1]")
        self.arrival_weight = arrival_weight
        self.prior_multiple = prior_multiple

    def _key(self, spec: JobSpec) -> float:
        ect = expected_completion(spec, self.prior_multiple)
        return self.arrival_weight * spec.arrival + (1 - self.arrival_weight) * ect


def by_qos_class(spec: JobSpec) -> str:
    return spec.qos.value


def capacities(shares: Mapping[str, float], total: int) -> dict[str, int]:
    """Whole GPUs per queue from ``shares`` of ``total`` by largest remainder: the GPUs left
    after rounding down go first to queues that have none, then by largest remainder (ties in
    the order ``shares`` lists them)."""
    weight = sum(shares.values())
    exact = {queue: total * share / weight for queue, share in shares.items()}
    whole = {queue: int(value) for queue, value in exact.items()}
    order = sorted(shares, key=lambda q: (whole[q] > 0, -(exact[q] - whole[q])))
    left = total - sum(whole.values())
    for queue in order[:left]:
        whole[queue] += 1
    return whole


class CapacityPolicy(Policy):
    """P3's Capacity baseline: every task type has a guaranteed capacity; a task uses what its
    user asked for within its type's capacity and never the capacity of another type (no
    borrowing, baseline (2)). One FIFO queue per type; a head that does not fit its type's
    capacity or the free GPUs holds back only its own queue. A task asking more than its
    type's whole capacity gets that capacity.

    ``queue_of`` names a task's type (default its QoS class) and ``shares`` the types' shares
    of the cluster (default :data:`QOS_SHARES`)."""

    base_name = "capacity"

    def __init__(
        self,
        *,
        locality: bool = False,
        queue_of: Callable[[JobSpec], str] = by_qos_class,
        shares: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(locality=locality)
        self.queue_of = queue_of
        self.shares = dict(shares or QOS_SHARES)

    def _capacity(self, spec: JobSpec, state: ClusterState) -> tuple[str, int, int]:
        """(queue, its capacity, GPUs its running tasks hold)."""
        queue = self.queue_of(spec)
        if queue not in self.shares:
            raise SchedulingError(f"job {spec.job_id!r}: no capacity share for queue {queue!r}")
        capacity = capacities(self.shares, state.total_gpus)[queue]
        held = sum(j.gpus_held for j in state.running if self.queue_of(j.spec) == queue)
        return queue, capacity, held

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        queue, capacity, held = self._capacity(job, state)
        return self._place(job, state, state.free_gpus(), queue, capacity, held)

    def _place(
        self,
        job: JobSpec,
        state: ClusterState,
        free: Mapping[str, int],
        queue: str,
        capacity: int,
        held: int,
    ) -> PlacementChoice | None:
        gpus = min(job.gpus, capacity)
        if gpus < 1 or held + gpus > capacity:
            return None
        room = candidate_free(job, free)
        prefer = self.preference(job, state)
        placement = first_fit(room, gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda _node: 0.0)
        return PlacementChoice(
            placement,
            ranking(job, state, score, room),
            f"capacity queue {queue!r}: {gpus} of its {capacity} GPUs",
        )

    def schedule(self, state: ClusterState) -> list[Decision]:
        free = state.free_gpus()
        queues: dict[str, list[JobState]] = {}
        for job in state.waiting:  # arrival order
            queues.setdefault(self.queue_of(job.spec), []).append(job)
        decisions: list[Decision] = []
        for queue, jobs in sorted(queues.items()):
            _queue, capacity, held = self._capacity(jobs[0].spec, state)
            blocked = False
            for job in jobs:
                choice = (
                    None if blocked else self._place(job.spec, state, free, queue, capacity, held)
                )
                if choice is None:
                    blocked = True
                    decisions.append(Wait(job.job_id, f"capacity queue {queue!r} is full"))
                    continue
                take(free, choice.placement)
                held += sum(choice.placement.values())
                decisions.append(Start(job.job_id, choice.placement, choice.explanation))
        return decisions


class TetrisPolicy(_ShapePlanner):
    """Tetris packing of P3's placements: each task's demand is its highest-PR placement
    (``term="perf"``, baseline (5)) or highest-CER one (``"cer"``, baseline (6)) over M_i.

    Repeatedly, among the waiting tasks whose demand fits the free GPUs, start the one of best
    score: alignment of its demand with the free GPUs (Σ GPUs · free GPUs on each chosen node /
    (GPUs · GPUs per node), Tetris' dot product; the nodes with most free GPUs are chosen, as
    they maximise it) + shortest-remaining-time term (fastest L of the round / its L), weighed
    1:1 (ours)."""

    base_name = "tetris"

    def __init__(self, *, locality: bool = False, theta: float = THETA, term: str = "perf") -> None:
        super().__init__(locality=locality, theta=theta)
        if term not in ("perf", "cer"):
            raise SchedulingError(f"Tetris term {term!r} is not 'perf' or 'cer'")
        self.term = term
        self._demands: dict[tuple[str, float, int, int], Option] = {}

    @property
    def name(self) -> str:
        return f"tetris+{self.term}" + ("+locality" if self.locality else "")

    def demand(self, job: JobState, state: ClusterState) -> Option | None:
        """The task's highest-PR (or highest-CER) option of M_i."""
        key = self._memo_key(job, state, None)
        if key is not None and key in self._demands:
            return self._demands[key]
        options = self.options(job, state)
        if not options:
            return None
        if self.term == "perf":
            best = max(options, key=lambda o: o.rate)
        else:
            best = max(options, key=lambda o: o.cer)
        if key is not None:
            if len(self._demands) > 65536:
                self._demands.clear()
            self._demands[key] = best
        return best

    def aligned(
        self, spec: JobSpec, state: ClusterState, option: Option, free: Mapping[str, int]
    ) -> dict[str, int] | None:
        """The demand's shape on the nodes with most free GPUs (preferred ones first)."""
        node_count, per_node = option.shape
        prefer = self.preference(spec, state) or (lambda _node: 0.0)
        room = candidate_free(spec, free)
        fitting = sorted(
            (n for n, count in room.items() if count >= per_node),
            key=lambda n: (-prefer(n), -room[n], n),
        )
        if len(fitting) < node_count:
            return None
        return {node: per_node for node in fitting[:node_count]}

    def schedule(self, state: ClusterState) -> list[Decision]:
        per_node = max(node.gpus for node in state.nodes.values())
        free = state.free_gpus()
        demands: dict[str, Option] = {}
        for job in state.waiting:
            option = self.demand(job, state)
            if option is not None:
                demands[job.job_id] = option
        waiting = [job for job in state.waiting if job.job_id in demands]
        decisions: list[Decision] = []
        while waiting:
            fastest = min(demands[job.job_id].seconds for job in waiting)
            best = None
            # Without a node preference or selector a shape lands on the same nodes for every
            # task of the round.
            by_shape: dict[tuple[int, int], dict[str, int] | None] = {}
            for job in waiting:
                option = demands[job.job_id]
                shared = not self.locality and job.spec.candidates is None
                if shared and option.shape in by_shape:
                    placement = by_shape[option.shape]
                else:
                    placement = self.aligned(job.spec, state, option, free)
                    if shared:
                        by_shape[option.shape] = placement
                if placement is None:
                    continue
                gpus = sum(placement.values())
                alignment = sum(g * free[n] for n, g in placement.items()) / (gpus * per_node)
                value = alignment + fastest / option.seconds
                if best is None or value > best[0]:
                    best = (value, job, placement)
            if best is None:
                break
            _value, job, placement = best
            take(free, placement)
            waiting.remove(job)
            decisions.append(Start(job.job_id, placement, self.name))
        started = {d.job_id for d in decisions if isinstance(d, Start)}
        decisions += [
            Wait(job.job_id, "its demand does not fit the free GPUs")
            for job in state.waiting
            if job.job_id not in started
        ]
        return decisions

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        option = self.demand(JobState(job), state)
        if option is None:
            return None
        placement = self.aligned(job, state, option, state.free_gpus())
        if placement is None:
            return None
        best = dataclasses.replace(option, placement=placement)
        return self._choice(job, state, best, f"{self.name}: highest-{self.term} placement")
