"""P4: adaptive single-node vs distributed allocation from the Roofline model.

The paper's algorithm (its section 3.4, steps 1-8, and Algorithms 1 and 2):

- A model costs W FLOPs per sample (one forward pass) and moves M bytes of memory; its
  arithmetic intensity is I = W / M (section 2.4). For a CNN, layer by layer (section 3.2,
  equations (2)-(5)): a convolution costs K^2 * C_in * H_out * W_out * C_out FLOPs and moves
  4 * (K^2 * C_in * C_out + H_out * W_out * C_out) bytes (float32 weights and outputs); a layer
  without weights moves its output only. :func:`layer_flops` and :func:`layer_memory_bytes`.
- A GPU with peak pi (FLOP/s) and memory bandwidth beta (bytes/s) attains min(pi, beta*I) FLOP/s
  (equation (1)); Algorithm 1 computes it per node and sorts the nodes by it
  (:func:`sort_by_compute`).
- Training one sample costs ``TRAIN_PASSES`` forward-pass equivalents (forward + backward; the
  paper does not say, we use 3, the usual estimate).
- Single node, equations (6), (7) and (11): T = tau + eta, tau = work / attainable, eta the node's
  mean historical overhead (0 at first).
- Distributed, equations (8), (9), (12)-(17): the work is split evenly over the set's nodes and
  T = max over its nodes of (tau_n + T_trans,n + eta_n), T_trans = syncs * 8*M / B (B in bits/s):
  the set is as slow as its slowest node. Every set of two or more nodes is evaluated this way.
- Step 6 / equation (18): the smaller of the best single-node time and the best distributed
  time decides between the two (a tie goes to fewer nodes: our choice).
- Step 7, only after the distributed set is chosen: synchronous or asynchronous by how much the
  chosen nodes' compute differs ("比較...它們的方差大小"): asynchronous when the coefficient of
  variation of their attainable compute exceeds ``async_cv`` (0.15; the paper names the
  variance but gives no threshold: a scale-free CV and 0.15 are our choices). The mode does not
  change the set or its predicted time.
- Above ``exhaustive_limit`` nodes (12, i.e. 4,095 subsets) only the best k-node set for each k
  is evaluated; that is exact: T(S) is the maximum of a per-node time that depends only on |S|,
  so the k nodes with the smallest such times are optimal.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .locality import io_seconds, with_io
from .model import ClusterState, JobSpec, Node, PlacementChoice, SchedulingError
from .policy import Policy, candidate_free, ranking

TRAIN_PASSES = 3.0


@dataclass(frozen=True)
class ModelCost:
    """P4's W (FLOPs of one forward pass per sample) and M (bytes of memory traffic)."""

    flops: float
    memory_bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity I = W / M, FLOP per byte."""
        return self.flops / self.memory_bytes


def attainable_flops(peak_flops: float, memory_bandwidth: float, intensity: float) -> float:
    """Roofline: the compute a GPU reaches at this intensity, min(π, β·I) (equation (1))."""
    return min(peak_flops, memory_bandwidth * intensity)


def layer_flops(kernel: int, c_in: int, h_out: int, w_out: int, c_out: int) -> float:
    """Equation (2): one layer's forward FLOPs, K²·C_in·H_out·W_out·C_out (multiply-adds
    counted once, as the paper's Table 1 does). A dense layer is K = H_out = W_out = 1."""
    return float(kernel * kernel * c_in * h_out * w_out * c_out)


def layer_memory_bytes(kernel: int, c_in: int, h_out: int, w_out: int, c_out: int) -> float:
    """Equation (3): one layer's memory traffic, float32 weights plus its output,
    4·(K²·C_in·C_out + H_out·W_out·C_out) bytes. A layer without weights (ReLU, LRN,
    pooling, the input) is ``kernel=0``: its output only."""
    return 4.0 * (kernel * kernel * c_in * c_out + h_out * w_out * c_out)


@dataclass(frozen=True)
class Worker:
    """A node as P4 sees it: its GPUs for this job and their hardware."""

    name: str
    gpus: int
    peak_flops: float
    memory_bandwidth: float
    network_bits_per_s: float | None
    overhead_s: float

    def attainable(self, cost: ModelCost) -> float:
        """FLOP/s of all this worker's GPUs together (perfect scaling inside a node)."""
        return self.gpus * attainable_flops(self.peak_flops, self.memory_bandwidth, cost.intensity)


@dataclass(frozen=True)
class Allocation:
    """A predicted allocation: which workers, how they synchronise, and the predicted time."""

    workers: tuple[str, ...]
    mode: str  # "single", "sync" or "async"
    seconds: float


def _transfer_seconds(worker: Worker, sync_bytes: float, syncs: float) -> float:
    """Equation (9): T_trans = syncs · 8·M / B (B in bits/s)."""
    if worker.network_bits_per_s is None:
        return float("inf")
    return syncs * 8.0 * sync_bytes / worker.network_bits_per_s


def sort_by_compute(workers: Sequence[Worker], cost: ModelCost) -> list[Worker]:
    """Algorithm 1: the nodes in ascending order of attainable compute (its quicksort; ties by
    name, so the order is deterministic)."""
    return sorted(workers, key=lambda w: (w.attainable(cost), w.name))


def sync_or_async(speeds: Sequence[float], async_cv: float = 0.15) -> str:
    """Step 7: "sync" for nodes of similar compute, "async" when the coefficient of variation
    of their attainable compute exceeds ``async_cv``."""
    spread = statistics.pstdev(speeds) / statistics.fmean(speeds)
    return "async" if spread > async_cv else "sync"


def predict(
    cost: ModelCost,
    workers: Sequence[Worker],
    samples: float,
    *,
    sync_bytes: float | None = None,
    syncs: float = 1.0,
    async_cv: float = 0.15,
) -> Allocation:
    """P4's predicted time of training ``samples`` on ``workers`` (one = single node).

    One worker: equation (6), τ + η. Several: equation (16), the work split evenly and the
    slowest node's τ_n + T_trans,n + η_n; then step 7 names the mode, which leaves the time as
    it is (the paper compares times before it chooses the mode).
    """
    flops = TRAIN_PASSES * cost.flops * samples
    names = tuple(w.name for w in workers)
    if len(workers) == 1:
        (worker,) = workers
        return Allocation(names, "single", flops / worker.attainable(cost) + worker.overhead_s)
    moved = cost.memory_bytes if sync_bytes is None else sync_bytes
    share = flops / len(workers)
    seconds = max(
        share / w.attainable(cost) + _transfer_seconds(w, moved, syncs) + w.overhead_s
        for w in workers
    )
    mode = sync_or_async([w.attainable(cost) for w in workers], async_cv)
    return Allocation(names, mode, seconds)


def candidate_sets(
    cost: ModelCost,
    workers: Sequence[Worker],
    samples: float,
    *,
    sync_bytes: float | None,
    syncs: float,
    exhaustive_limit: int,
) -> list[tuple[Worker, ...]]:
    """The worker sets to evaluate: all non-empty subsets, or the per-size best sets."""
    ordered = sort_by_compute(workers, cost)
    if len(ordered) <= exhaustive_limit:
        return [
            subset
            for size in range(1, len(ordered) + 1)
            for subset in itertools.combinations(ordered, size)
        ]
    moved = cost.memory_bytes if sync_bytes is None else sync_bytes
    flops = TRAIN_PASSES * cost.flops * samples
    sets: list[tuple[Worker, ...]] = []
    for size in range(1, len(ordered) + 1):

        def node_time(w: Worker, size: int = size) -> float:
            transfer = _transfer_seconds(w, moved, syncs) if size > 1 else 0.0
            return flops / size / w.attainable(cost) + transfer + w.overhead_s

        sets.append(tuple(sorted(ordered, key=lambda w: (node_time(w), w.name))[:size]))
    return sets


def best_allocation(
    cost: ModelCost,
    workers: Sequence[Worker],
    samples: float,
    *,
    sync_bytes: float | None = None,
    syncs: float = 1.0,
    async_cv: float = 0.15,
    exhaustive_limit: int = 12,
) -> Allocation:
    """Steps 2-7: the fastest predicted allocation over single nodes (equation (11)) and node
    combinations (equation (17)), the smaller of the two (equation (18)), its mode named by
    step 7 afterwards. Ties go to fewer nodes, then names."""
    if not workers:
        raise SchedulingError("P4 needs at least one worker to choose from")
    sets = candidate_sets(
        cost,
        workers,
        samples,
        sync_bytes=sync_bytes,
        syncs=syncs,
        exhaustive_limit=exhaustive_limit,
    )
    predictions = [
        predict(cost, subset, samples, sync_bytes=sync_bytes, syncs=syncs, async_cv=async_cv)
        for subset in sets
    ]
    return min(predictions, key=lambda a: (a.seconds, len(a.workers), a.workers))


def worker_from_node(node: Node, gpus: int) -> Worker:
    if node.peak_flops is None or node.memory_bandwidth is None:
        raise SchedulingError(
            f"policy p4-roofline needs peak_flops and memory_bandwidth for node {node.name!r}"
        )
    return Worker(
        node.name,
        gpus,
        node.peak_flops,
        node.memory_bandwidth,
        node.network_bits_per_s,
        node.overhead_s,
    )


def model_cost(spec: JobSpec) -> ModelCost:
    profile = spec.profile
    if not profile.forward_flops or not profile.memory_bytes:
        raise SchedulingError(
            f"policy p4-roofline needs forward_flops and memory_bytes for model {profile.name!r}"
        )
    return ModelCost(profile.forward_flops, profile.memory_bytes)


class RooflinePolicy(Policy):
    """P4 as a cluster policy: FIFO, each job on its fastest predicted node set.

    Each node offers its free GPUs (at most the job's cap); node sets offering more GPUs than the
    cap are skipped. Data-parallel jobs synchronise once per global batch. "+locality": a node
    set's time is max(Roofline time, I/O time of reading the job's remaining data there).
    """

    base_name = "p4-roofline"

    def __init__(
        self, *, locality: bool = False, async_cv: float = 0.15, exhaustive_limit: int = 12
    ) -> None:
        super().__init__(locality=locality)
        self.async_cv = async_cv
        self.exhaustive_limit = exhaustive_limit

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        cost = model_cost(job)
        cap = job.max_gpus or job.gpus
        free = candidate_free(job, state.free_gpus())
        workers = [
            worker_from_node(state.nodes[name], min(count, cap))
            for name, count in sorted(free.items())
            if count > 0
        ]
        if not workers:
            return None
        syncs = job.samples / job.batch_size
        sets = candidate_sets(
            cost,
            workers,
            job.samples,
            sync_bytes=job.profile.sync_bytes,
            syncs=syncs,
            exhaustive_limit=self.exhaustive_limit,
        )
        best: tuple[float, Allocation, dict[str, int]] | None = None
        for subset in sets:
            placement = {w.name: w.gpus for w in subset}
            if sum(placement.values()) > cap:
                continue
            predicted = predict(
                cost,
                subset,
                job.samples,
                sync_bytes=job.profile.sync_bytes,
                syncs=syncs,
                async_cv=self.async_cv,
            )
            seconds = predicted.seconds
            if self.locality:
                seconds = with_io(seconds, io_seconds(job, placement, state, job.samples))
            key = (seconds, len(subset))
            if best is None or key < (best[0], len(best[1].workers)):
                best = (seconds, predicted, placement)
        if best is None:
            return None
        seconds, allocation, placement = best
        speed = {w.name: w.attainable(cost) for w in workers}
        return PlacementChoice(
            placement,
            ranking(job, state, lambda n: speed.get(n, 0.0), free),
            f"Roofline: {allocation.mode} on {len(placement)} node(s), I={cost.intensity:.2f}",
            seconds,
        )
