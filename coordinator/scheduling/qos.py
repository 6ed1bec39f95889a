"""P3: QoS-aware dynamic scheduling for a shared GPU cluster, and its six baselines.

Model (see :mod:`.perf`): L(t, s) = samples / PR(t, s) + v with PR = (G − Comm(s))·sPR, sPR a
quadratic in the local batch (fitted by :func:`fit_quadratic_throughput`) and γ, λ regressed
from profiled runs (:func:`fit_comm_penalty`).

Expected completion time (ECT), from arrival: Urgent = 0 (must start at once), Prior =
``prior_multiple`` × single-GPU time, Normal = ``normal_multiple`` × single-GPU time (2x).

Cost of a placement = GPUs used / cluster GPUs + θ · nodes spanned / cluster nodes (compact =
cheaper); CER = performance / cost with performance = 1 / L.

At every arrival or completion, for each waiting task: keep the symmetric placements with
now + L ≤ ECT and take the highest-CER one (slack w = ECT − (now + L)); a task with none takes
its highest-CER placement (negative slack); Urgent tasks come first. Tasks are dispatched in
order of smallest slack until resources run out; a task whose pick was taken by an earlier one
is re-planned on what is left.

"+locality": L includes the I/O stall (:mod:`.locality`) and, among nodes of equal shape, those
holding the job's data are chosen first.
"""

from __future__ import annotations

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
from .policy import Policy, candidate_free, ranking, take, with_free

PRIOR_MULTIPLE = 1.0
NORMAL_MULTIPLE = 2.0


# --- fitting (offline profiling) ---------------------------------------------------------------


def fit_quadratic_throughput(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares quadratic ``a + b·x + c·x²`` through (local batch, samples/s per GPU)."""
    if len({x for x, _ in points}) < 3:
        raise SchedulingError("a quadratic throughput fit needs at least 3 distinct batch sizes")
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
    return compute_seconds(spec, {"gpu": 1}, spec.samples)


def expected_completion(
    spec: JobSpec, prior_multiple: float = PRIOR_MULTIPLE, normal_multiple: float = NORMAL_MULTIPLE
) -> float:
    """P3's ECT as an absolute time. For Urgent it is the arrival: the task must start at once."""
    if spec.qos is QosClass.URGENT:
        return spec.arrival
    multiple = prior_multiple if spec.qos is QosClass.PRIOR else normal_multiple
    return spec.arrival + multiple * single_gpu_seconds(spec)


def placement_cost(placement: Placement, state: ClusterState, theta: float) -> float:
    """Fraction of the cluster's GPUs used + θ · fraction of its nodes spanned."""
    return sum(placement.values()) / state.total_gpus + theta * nodes_spanned(placement) / len(
        state.nodes
    )


@dataclass(frozen=True)
class Option:
    """One candidate placement of a task with its predicted time and CER."""

    placement: dict[str, int]
    seconds: float
    cer: float


class _ShapePlanner(Policy):
    """Shared by P3 and the baselines that pick shapes with the performance model."""

    def __init__(self, *, locality: bool = False, theta: float = 0.5) -> None:
        super().__init__(locality=locality)
        self.theta = theta
        # Without "+locality" a placement's time and cost depend only on its shape, so they are
        # remembered per (job, samples left, shape, cluster size): queues are re-planned often.
        self._by_shape: dict[tuple[str, float, int, int, int, int], tuple[float, float]] = {}
        self._layout_memo: dict[tuple[object, int], list[tuple[int, int, dict[str, int]]]] = {}

    def options(self, job: JobState, state: ClusterState, free: Mapping[str, int]) -> list[Option]:
        """Every feasible symmetric placement of ``job`` on ``free`` with time and CER."""
        spec = job.spec
        cap = spec.max_gpus or spec.gpus
        found = []
        for node_count, per_node, placement in self._layouts(spec, state, free, cap):
            seconds, cost = self._time_and_cost(job, placement, state, node_count, per_node)
            if seconds == float("inf"):
                continue
            # A job of next to no samples can take 0 s (the product underflows): no cost.
            spent = seconds * cost
            found.append(Option(placement, seconds, 1.0 / spent if spent > 0 else float("inf")))
        return found

    def _layouts(
        self, spec: JobSpec, state: ClusterState, free: Mapping[str, int], cap: int
    ) -> list[tuple[int, int, dict[str, int]]]:
        """(d_node, d_gpu, placement) for every feasible shape. Without a node preference or a
        node selector the answer depends only on the free GPUs, so it is shared by all tasks."""
        shared = spec.candidates is None and not self.locality
        key = (tuple(sorted(free.items())), cap)
        if shared and key in self._layout_memo:
            return self._layout_memo[key]
        free = candidate_free(spec, free)
        prefer = self.preference(spec, state)
        layouts = []
        for node_count, per_node in symmetric_shapes(free, cap):
            placement = place_shape(free, node_count, per_node, prefer)
            if placement is not None:
                layouts.append((node_count, per_node, placement))
        if shared:
            if len(self._layout_memo) > 4096:
                self._layout_memo.clear()
            self._layout_memo[key] = layouts
        return layouts

    def _time_and_cost(
        self,
        job: JobState,
        placement: dict[str, int],
        state: ClusterState,
        node_count: int,
        per_node: int,
    ) -> tuple[float, float]:
        key = (
            job.job_id,
            job.remaining_samples,
            node_count,
            per_node,
            state.total_gpus,
            len(state.nodes),
        )
        if self.locality or key not in self._by_shape:
            seconds = self.predicted_seconds(job.spec, placement, state, job.remaining_samples)
            value = (seconds, placement_cost(placement, state, self.theta))
            if self.locality:
                return value
            self._by_shape[key] = value
        return self._by_shape[key]

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        """For one job: its highest-CER placement (the endpoint has no queue to order)."""
        options = self.options(JobState(job), state, state.free_gpus())
        if not options:
            return None
        best = max(options, key=lambda o: o.cer)
        return self._choice(job, state, best, f"highest CER placement (θ={self.theta})")

    def _choice(self, job: JobSpec, state: ClusterState, best: Option, why: str) -> PlacementChoice:
        free = candidate_free(job, state.free_gpus())
        in_best = set(best.placement)
        prefer = self.preference(job, state) or (lambda _node: 0.0)

        def score(node: str) -> float:
            return (node in in_best) * 1e18 + prefer(node) * 1e3 - free[node]

        return PlacementChoice(best.placement, ranking(job, state, score, free), why, best.seconds)


class QosPolicy(_ShapePlanner):
    """P3: ECT-feasible placements, highest CER, smallest slack first."""

    base_name = "p3-qos"

    def __init__(
        self,
        *,
        locality: bool = False,
        theta: float = 0.5,
        prior_multiple: float = PRIOR_MULTIPLE,
        normal_multiple: float = NORMAL_MULTIPLE,
    ) -> None:
        super().__init__(locality=locality, theta=theta)
        self.prior_multiple = prior_multiple
        self.normal_multiple = normal_multiple

    def plan(
        self, job: JobState, state: ClusterState, free: Mapping[str, int]
    ) -> tuple[float, Option] | None:
        """(slack, option) for one task on ``free``, or None when nothing fits."""
        options = self.options(job, state, free)
        if not options:
            return None
        ect = expected_completion(job.spec, self.prior_multiple, self.normal_multiple)
        if job.spec.qos is QosClass.URGENT:
            return float("-inf"), max(options, key=lambda o: o.cer)
        feasible = [o for o in options if state.now + o.seconds <= ect]
        best = max(feasible or options, key=lambda o: o.cer)
        return ect - (state.now + best.seconds), best

    def schedule(self, state: ClusterState) -> list[Decision]:
        free = state.free_gpus()
        planned = []
        for job in state.waiting:
            plan = self.plan(job, state, free)
            if plan is not None:
                planned.append((plan[0], job.spec.arrival, job, plan[1]))
        planned.sort(key=lambda row: (row[0], row[1], row[2].job_id))

        decisions: list[Decision] = []
        started = set()
        for _slack, _arrival, job, option in planned:
            if not all(free[node] >= count for node, count in option.placement.items()):
                replanned = self.plan(job, state, free)
                if replanned is None:
                    continue
                option = replanned[1]
            take(free, option.placement)
            started.add(job.job_id)
            decisions.append(
                Start(job.job_id, option.placement, f"slack-ordered, CER {option.cer:.3g}")
            )
        decisions += [
            Wait(job.job_id, "no free GPUs left for it in slack order")
            for job in state.waiting
            if job.job_id not in started
        ]
        return decisions

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        plan = self.plan(JobState(job), state, state.free_gpus())
        if plan is None:
            return None
        slack, best = plan
        why = (
            "urgent: highest CER placement"
            if job.qos is QosClass.URGENT
            else f"highest CER placement meeting the ECT if any (slack {slack:.0f} s)"
        )
        return self._choice(job, state, best, why)


# --- baselines --------------------------------------------------------------------------------


class _ClassQueuePolicy(Policy):
    """One FIFO queue per QoS class; the class to serve next is chosen by ``_priority``.

    Each task gets the GPUs it asked for, first fit. Used by Capacity and Weighted Fair.
    """

    @abstractmethod
    def _priority(self, qos: QosClass, used: Mapping[QosClass, int], total: int) -> float:
        """Lower is served first."""

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        free = candidate_free(job, state.free_gpus())
        prefer = self.preference(job, state)
        placement = first_fit(free, job.gpus, prefer)
        if placement is None:
            return None
        score = prefer or (lambda _node: 0.0)
        return PlacementChoice(placement, ranking(job, state, score, free), self.base_name)

    def schedule(self, state: ClusterState) -> list[Decision]:
        used = {qos: 0 for qos in QosClass}
        for job in state.running:
            used[job.spec.qos] += job.gpus_held
        queues = {qos: [job for job in state.waiting if job.spec.qos is qos] for qos in QosClass}
        free = state.free_gpus()
        decisions: list[Decision] = []
        while True:
            served = False
            # Serve queues in priority order; a queue whose head does not fit is skipped.
            order = sorted(
                (qos for qos in QosClass if queues[qos]),
                key=lambda q: (self._priority(q, used, state.total_gpus), q.value),
            )
            for qos in order:
                head = queues[qos][0]
                choice = self.place(head.spec, with_free(state, free))
                if choice is None:
                    continue
                take(free, choice.placement)
                used[qos] += head.spec.gpus
                queues[qos].pop(0)
                decisions.append(Start(head.job_id, choice.placement, f"{qos.value} queue"))
                served = True
                break
            if not served:
                break
        decisions += [
            Wait(job.job_id, "its queue's head does not fit")
            for queue in queues.values()
            for job in queue
        ]
        return decisions


class CapacityPolicy(_ClassQueuePolicy):
    """Capacity scheduler: each class has a guaranteed share of the cluster and may borrow idle
    GPUs; the queue using the least of its guarantee is served first."""

    base_name = "capacity"

    def __init__(
        self, *, locality: bool = False, shares: Mapping[QosClass, float] | None = None
    ) -> None:
        super().__init__(locality=locality)
        self.shares = dict(
            shares or {QosClass.URGENT: 0.05, QosClass.PRIOR: 0.35, QosClass.NORMAL: 0.60}
        )

    def _priority(self, qos: QosClass, used: Mapping[QosClass, int], total: int) -> float:
        return used[qos] / (self.shares[qos] * total)


class WeightedFairPolicy(_ClassQueuePolicy):
    """Weighted fair sharing: a class's fair share is its weight's fraction of the cluster; the
    class furthest below its fair share is served first."""

    base_name = "weighted-fair"

    def __init__(
        self, *, locality: bool = False, weights: Mapping[QosClass, float] | None = None
    ) -> None:
        super().__init__(locality=locality)
        self.weights = dict(
            weights or {QosClass.URGENT: 4.0, QosClass.PRIOR: 2.0, QosClass.NORMAL: 1.0}
        )

    def _priority(self, qos: QosClass, used: Mapping[QosClass, int], total: int) -> float:
        fair_share = total * self.weights[qos] / sum(self.weights.values())
        return used[qos] - fair_share


class MinMinPolicy(_ShapePlanner):
    """Min-Min: repeatedly start the task whose best placement finishes soonest."""

    base_name = "min-min"

    def schedule(self, state: ClusterState) -> list[Decision]:
        return _greedy_rounds(self, state, lambda option, _free, _round: -option.seconds)


@dataclass(frozen=True)
class _Round:
    """What the scores of one round are normalised by: the fastest time and best CER seen."""

    fastest: float
    best_cer: float


class TetrisPolicy(_ShapePlanner):
    """Tetris-style packing: score = alignment of the placement with free GPUs + a second term.

    Alignment = Σ GPUs·free GPUs on each chosen node / (GPUs · GPUs per node) (Tetris' dot
    product, preferring well-fitting nodes). The second term is ``perf`` (shortest predicted
    time first across all tasks, Tetris' SRTF term fed by the performance model) or ``cer``
    (CER over the best CER of the round).
    """

    base_name = "tetris"

    def __init__(self, *, locality: bool = False, theta: float = 0.5, term: str = "perf") -> None:
        super().__init__(locality=locality, theta=theta)
        if term not in ("perf", "cer"):
            raise SchedulingError(f"Tetris term {term!r} is not 'perf' or 'cer'")
        self.term = term

    @property
    def name(self) -> str:
        return f"tetris+{self.term}" + ("+locality" if self.locality else "")

    def schedule(self, state: ClusterState) -> list[Decision]:
        per_node = max(node.gpus for node in state.nodes.values())

        def score(option: Option, free: Mapping[str, int], round_: _Round) -> float:
            gpus = sum(option.placement.values())
            alignment = sum(g * free[n] for n, g in option.placement.items()) / (gpus * per_node)
            if self.term == "perf":
                return alignment + round_.fastest / option.seconds
            return alignment + option.cer / round_.best_cer

        return _greedy_rounds(self, state, score)


def _greedy_rounds(
    policy: _ShapePlanner,
    state: ClusterState,
    score: Callable[[Option, Mapping[str, int], _Round], float],
) -> list[Decision]:
    """Start the best-scoring (task, placement) pair, then re-score on what is left; repeat."""
    free = state.free_gpus()
    waiting = list(state.waiting)
    decisions: list[Decision] = []
    while waiting:
        options = {job.job_id: policy.options(job, state, free) for job in waiting}
        every = [option for found in options.values() for option in found]
        if not every:
            break
        round_ = _Round(min(o.seconds for o in every), max(o.cer for o in every))
        best = None
        for job in waiting:
            for option in options[job.job_id]:
                value = score(option, free, round_)
                if best is None or value > best[0]:
                    best = (value, job, option)
        assert best is not None
        _value, job, option = best
        take(free, option.placement)
        waiting.remove(job)
        decisions.append(Start(job.job_id, option.placement, policy.name))
    decisions += [Wait(job.job_id, "no placement fits") for job in waiting]
    return decisions
