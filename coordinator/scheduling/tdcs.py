"""P1's TDCS placement: task and data co-located scheduling (the CacheManager's part).

For job T using dataset D:
- S1 = the nodes of a cached copy D' of D (from the CacheManager);
- S2 = the candidate nodes that can run T (free GPUs, within T's node selector);
- S3 = S1 ∩ S2 is the high-priority set: T takes GPUs greedily from S3 (nodes holding the most
  cached bytes first, then the most free GPUs), then fills from the rest of S2 (most free
  GPUs first, so the job spans few nodes).

Hot spots: at most ``max_jobs_per_copy`` running jobs share one copy. An over-limit job is
either **suspended** (waits; it is placed, preferring the copy, when a job releases the copy)
or **cloned** (a new copy D'' is made on other nodes Si and the job placed there).

TDCS is a locality policy by construction, so it has no separate "+locality" variant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .locality import cached_on
from .model import (
    Clone,
    ClusterState,
    Dataset,
    Decision,
    JobSpec,
    Placement,
    PlacementChoice,
    SchedulingError,
    Start,
    Wait,
)
from .placement import fill_in_order
from .policy import Policy, candidate_free, ranking, take, with_free

OVERFLOW_POLICIES = ("suspend", "clone")


def copy_of(placement: Placement, copies: list[frozenset[str]]) -> int | None:
    """Index of the copy a job on ``placement`` reads from: the one sharing the most nodes."""
    best, best_overlap = None, 0
    for index, nodes in enumerate(copies):
        overlap = sum(1 for node in placement if node in nodes)
        if overlap > best_overlap:
            best, best_overlap = index, overlap
    return best


def greedy_on_copy(
    free: Mapping[str, int], gpus: int, copy_nodes: frozenset[str], dataset: Dataset | None
) -> dict[str, int] | None:
    """S3 first (most cached bytes, then most free GPUs), then the rest of S2 (most free)."""
    s2 = [node for node, count in free.items() if count > 0]
    s3 = sorted(
        (node for node in s2 if node in copy_nodes),
        key=lambda n: (-cached_on(dataset, n), -free[n], n),
    )
    rest = sorted((node for node in s2 if node not in copy_nodes), key=lambda n: (-free[n], n))
    return fill_in_order(free, gpus, s3 + rest)


class TdcsPolicy(Policy):
    """P1's co-located placement with Suspend or Clone on hot copies."""

    base_name = "tdcs"

    def __init__(self, *, max_jobs_per_copy: int = 2, overflow: str = "suspend") -> None:
        super().__init__(locality=False)
        if overflow not in OVERFLOW_POLICIES:
            raise SchedulingError(
                f"TDCS overflow policy {overflow!r} is not one of {', '.join(OVERFLOW_POLICIES)}"
            )
        if max_jobs_per_copy < 1:
            raise SchedulingError(f"max_jobs_per_copy={max_jobs_per_copy} must be at least 1")
        self.max_jobs_per_copy = max_jobs_per_copy
        self.overflow = overflow

    @property
    def name(self) -> str:
        return "tdcs-clone" if self.overflow == "clone" else "tdcs"

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        decision = self._decide(job, state, self._jobs_per_copy(state))
        if not isinstance(decision, tuple):
            return None
        placement, clone, explanation = decision
        dataset = state.dataset(job.dataset)
        copy_nodes = clone.nodes if clone else _copy_holding(placement, dataset)
        free = candidate_free(job, state.free_gpus())

        def score(node: str) -> float:
            # S3 before the rest of S2, then the greedy order within each.
            return (node in copy_nodes) * 1e18 + cached_on(dataset, node) * 1e3 + free[node]

        return PlacementChoice(placement, ranking(job, state, score, free), explanation)

    def schedule(self, state: ClusterState) -> list[Decision]:
        """FIFO; a job short of GPUs blocks the queue, a suspended job does not."""
        free = state.free_gpus()
        per_copy = self._jobs_per_copy(state)
        decisions: list[Decision] = []
        blocked = False
        for job in state.waiting:
            if blocked:
                decisions.append(Wait(job.job_id, "behind an earlier job in FIFO order"))
                continue
            outcome = self._decide(job.spec, with_free(state, free), per_copy)
            if isinstance(outcome, str):
                decisions.append(Wait(job.job_id, outcome))
                blocked = outcome.startswith("not enough")
                continue
            placement, clone, explanation = outcome
            take(free, placement)
            if clone is not None:
                decisions.append(clone)
                state = _with_copy(state, clone)
            decisions.append(Start(job.job_id, placement, explanation))
        return decisions

    # --- internals ---------------------------------------------------------------------

    def _jobs_per_copy(self, state: ClusterState) -> dict[tuple[str, int], int]:
        """(dataset, copy index) -> running jobs reading that copy."""
        counts: dict[tuple[str, int], int] = {}
        for job in state.running:
            dataset = state.dataset(job.spec.dataset)
            if dataset is None:
                continue
            index = copy_of(job.placement, dataset.copy_nodes())
            if index is not None:
                key = (dataset.name, index)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def _decide(
        self, job: JobSpec, state: ClusterState, per_copy: dict[tuple[str, int], int]
    ) -> tuple[dict[str, int], Clone | None, str] | str:
        """(placement, clone or None, explanation), or the reason the job waits.

        ``per_copy`` is updated for a job that starts, so later jobs in the same pass see it.
        """
        free = candidate_free(job, state.free_gpus())
        if sum(free.values()) < job.gpus:
            return "not enough free GPUs"
        dataset = state.dataset(job.dataset)
        copies = dataset.copy_nodes() if dataset else []
        if not copies:
            placement = greedy_on_copy(free, job.gpus, frozenset(), dataset)
            assert placement is not None  # enough free GPUs were checked above
            return placement, None, "no cached copy: most free GPUs first"

        open_copies = [
            index
            for index in range(len(copies))
            if per_copy.get((job.dataset or "", index), 0) < self.max_jobs_per_copy
        ]
        if open_copies:
            # The copy that lets the job take the most GPUs on its own nodes (S3) wins.
            def on_copy(index: int) -> tuple[int, int]:
                placement = greedy_on_copy(free, job.gpus, copies[index], dataset)
                assert placement is not None
                return sum(c for n, c in placement.items() if n in copies[index]), -index

            index = max(open_copies, key=on_copy)
            placement = greedy_on_copy(free, job.gpus, copies[index], dataset)
            assert placement is not None
            key = (job.dataset or "", index)
            per_copy[key] = per_copy.get(key, 0) + 1
            on_s3 = sum(c for n, c in placement.items() if n in copies[index])
            return placement, None, f"copy {index} of {job.dataset}: {on_s3}/{job.gpus} GPUs in S3"

        if self.overflow == "suspend":
            return (
                f"suspended: every cached copy of {job.dataset} already serves "
                f"{self.max_jobs_per_copy} jobs"
            )
        return self._clone(job, free, copies, per_copy)

    def _clone(
        self,
        job: JobSpec,
        free: dict[str, int],
        copies: list[frozenset[str]],
        per_copy: dict[tuple[str, int], int],
    ) -> tuple[dict[str, int], Clone | None, str] | str:
        """Clone: a new copy on nodes Si outside every existing copy, the job placed on Si."""
        used = frozenset().union(*copies)
        outside = {node: count for node, count in free.items() if node not in used}
        placement = fill_in_order(
            outside, job.gpus, sorted(outside, key=lambda n: (-outside[n], n))
        )
        if placement is None:
            return "not enough free GPUs outside the existing copies to clone onto"
        new_copy = frozenset(placement)
        per_copy[(job.dataset or "", len(copies))] = 1
        explanation = f"cloned {job.dataset} onto {', '.join(sorted(new_copy))}"
        return placement, Clone(job.dataset or "", new_copy), explanation


def _copy_holding(placement: Placement, dataset: Dataset | None) -> frozenset[str]:
    copies = dataset.copy_nodes() if dataset else []
    index = copy_of(placement, copies)
    return copies[index] if index is not None else frozenset()


def _with_copy(state: ClusterState, clone: Clone) -> ClusterState:
    """``state`` with the cloned copy added, so later jobs in the same pass can share it."""
    dataset = state.datasets[clone.dataset]
    copies = (*dataset.copy_nodes(), clone.nodes)
    datasets = {**state.datasets, clone.dataset: dataclasses.replace(dataset, copies=copies)}
    return dataclasses.replace(state, datasets=datasets)
