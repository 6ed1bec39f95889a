"""What a placement policy sees (cluster state) and what it answers (decisions).

The same types serve the trace-driven simulator (``bench.sim``) and the live placement endpoint
(``coordinator.scheduling.http``). Times are seconds on the caller's clock (simulated time in
the simulator); policies never read a wall clock. Byte counts are plain ints, bandwidths are
bytes per second unless a name says otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

#: node name -> GPUs the job holds there. Nodes with 0 GPUs are never listed.
Placement = Mapping[str, int]


class SchedulingError(ValueError):
    """Bad input to a policy or an impossible request; the message says what and why."""


class QosClass(enum.Enum):
    """P3's expected-completion-time classes."""

    URGENT = "urgent"
    PRIOR = "prior"
    NORMAL = "normal"


@dataclass(frozen=True)
class Node:
    """One GPU node as the scheduler sees it.

    The hardware facts are optional: only the Roofline policy (P4) needs them.
    """

    name: str
    gpus: int
    free_gpus: int
    #: peak compute of one GPU, FLOP/s (P4's π).
    peak_flops: float | None = None
    #: memory bandwidth of one GPU, bytes/s (P4's β).
    memory_bandwidth: float | None = None
    #: network bandwidth of the node, bits/s (P4's B).
    network_bits_per_s: float | None = None
    #: measured per-job overhead on this node, seconds (P4's η).
    overhead_s: float = 0.0
    cache_capacity: int = 0
    cache_used: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise SchedulingError("a node needs a non-empty name")
        if self.gpus < 0 or not 0 <= self.free_gpus <= self.gpus:
            raise SchedulingError(
                f"node {self.name!r}: free_gpus={self.free_gpus} must lie in [0, gpus={self.gpus}]"
            )


@dataclass(frozen=True)
class Dataset:
    """A dataset and where its cached bytes are (the live locality)."""

    name: str
    size: int
    #: node -> bytes of this dataset cached on that node.
    cached: Mapping[str, int] = field(default_factory=dict)
    #: the CacheManager's copies (each a node set), used by TDCS; empty = derive from ``cached``.
    copies: tuple[frozenset[str], ...] = ()

    def __post_init__(self) -> None:
        if self.size < 0:
            raise SchedulingError(f"dataset {self.name!r}: size {self.size} is negative")
        bad = {node: held for node, held in self.cached.items() if held < 0}
        if bad:
            raise SchedulingError(f"dataset {self.name!r}: negative cached bytes on {bad}")

    @property
    def cached_total(self) -> int:
        """Bytes cached anywhere, never more than the dataset (copies may duplicate bytes)."""
        return min(self.size, sum(self.cached.values()))

    def copy_nodes(self) -> list[frozenset[str]]:
        """The copies, or one copy made of every node holding bytes when none were declared."""
        if self.copies:
            return list(self.copies)
        holders = frozenset(node for node, held in self.cached.items() if held > 0)
        return [holders] if holders else []


@dataclass(frozen=True)
class IoBandwidth:
    """Where training data can come from, and how fast (bytes/s); used by "+locality" models."""

    local_per_node: float = 4e9
    peer_per_node: float = 1.2e9
    store_per_node: float = 0.35e9
    store_total: float = 20e9


@dataclass(frozen=True)
class ModelProfile:
    """What a scheduler knows about a model before the job runs (from offline profiling).

    Per-GPU throughput is P3's quadratic in the local batch size (samples/s per GPU):
    ``a + b*x + c*x**2``, valid over ``[batch_min, batch_max]`` (clamped outside).
    ``comm_gamma``/``comm_lambda`` are P3's communication penalty; ``forward_flops`` and
    ``memory_bytes`` are P4's W and M for one sample.
    """

    name: str
    throughput_coeffs: tuple[float, float, float]
    batch_min: float = 1.0
    batch_max: float = 1024.0
    comm_gamma: float = 0.0
    comm_lambda: float = 1.0
    forward_flops: float | None = None
    memory_bytes: float | None = None
    #: bytes of model state exchanged per synchronisation (P4's T_trans uses M when absent).
    sync_bytes: float | None = None
    #: seconds to start or restart a job (P3's v).
    startup_s: float = 0.0


@dataclass(frozen=True)
class JobSpec:
    """A training job as submitted."""

    job_id: str
    arrival: float
    #: GPUs asked for: the gang size for non-elastic policies, an upper bound for elastic ones.
    gpus: int
    profile: ModelProfile
    #: samples to process in total (epochs x samples per epoch).
    samples: float
    samples_per_epoch: int
    #: global batch (split across GPUs) unless ``batch_per_gpu`` is set.
    batch_size: int = 256
    batch_per_gpu: bool = False
    dataset: str | None = None
    qos: QosClass = QosClass.NORMAL
    #: the most GPUs an elastic policy may give this job (default: ``gpus``).
    max_gpus: int | None = None
    #: nodes the job may run on (a node selector); None = any node.
    candidates: frozenset[str] | None = None
    #: the application the job belongs to (P5's apps: a hyper-parameter search is one app of
    #: many jobs); None = the job is an app of its own.
    app: str | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise SchedulingError(f"job {self.job_id!r}: gpus={self.gpus}, need at least 1")
        if self.samples <= 0 or self.samples_per_epoch <= 0:
            raise SchedulingError(f"job {self.job_id!r}: samples must be positive")
        if self.max_gpus is not None and self.max_gpus < 1:
            raise SchedulingError(f"job {self.job_id!r}: max_gpus={self.max_gpus} < 1")

    @property
    def app_id(self) -> str:
        """The job's application: ``app``, or the job itself when it names none."""
        return self.app if self.app is not None else self.job_id

    @property
    def gpu_cap(self) -> int:
        return self.max_gpus if self.max_gpus is not None else self.gpus

    @property
    def epochs(self) -> float:
        return self.samples / self.samples_per_epoch


@dataclass(frozen=True)
class JobState:
    """A job the cluster knows: running when ``placement`` is non-empty, else waiting."""

    spec: JobSpec
    placement: Placement = field(default_factory=dict)
    samples_done: float = 0.0
    #: GPU-seconds received so far (Tiresias' attained service).
    attained_gpu_s: float = 0.0
    #: (GPUs, measured seconds per epoch) observations, oldest first (P2's fit input).
    observations: tuple[tuple[int, float], ...] = ()
    first_start: float | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def gpus_held(self) -> int:
        return sum(self.placement.values())

    @property
    def remaining_samples(self) -> float:
        return max(0.0, self.spec.samples - self.samples_done)


@dataclass(frozen=True)
class ClusterState:
    """Everything a policy gets at one decision point."""

    now: float
    nodes: Mapping[str, Node]
    datasets: Mapping[str, Dataset] = field(default_factory=dict)
    running: tuple[JobState, ...] = ()
    #: waiting jobs in arrival order.
    waiting: tuple[JobState, ...] = ()
    io: IoBandwidth = field(default_factory=IoBandwidth)

    @property
    def total_gpus(self) -> int:
        return sum(node.gpus for node in self.nodes.values())

    def free_gpus(self) -> dict[str, int]:
        return {name: node.free_gpus for name, node in self.nodes.items()}

    def dataset(self, name: str | None) -> Dataset | None:
        return None if name is None else self.datasets.get(name)


# --- decisions ------------------------------------------------------------------------------
# The decisions of one ``schedule`` call form a batch: every Resize gives up the job's GPUs
# before any placement of the batch is made, so a batch may move jobs into GPUs that another
# job of the same batch releases.


@dataclass(frozen=True)
class Start:
    """Start a waiting job on ``placement``."""

    job_id: str
    placement: Placement
    reason: str = ""


@dataclass(frozen=True)
class Resize:
    """Move a running job to ``placement`` (checkpoint and restart); empty = preempt to queue."""

    job_id: str
    placement: Placement
    reason: str = ""


@dataclass(frozen=True)
class Wait:
    """Leave a waiting job queued, saying why."""

    job_id: str
    reason: str


@dataclass(frozen=True)
class Clone:
    """TDCS Clone: make another cached copy of ``dataset`` on ``nodes``."""

    dataset: str
    nodes: frozenset[str]


Decision = Start | Resize | Wait | Clone


@dataclass(frozen=True)
class NodeScore:
    """One row of a policy's ranking of nodes for a job (higher score = preferred)."""

    node: str
    score: float
    free_gpus: int
    cached_bytes: int


@dataclass(frozen=True)
class PlacementChoice:
    """A policy's answer for one job: where, why, and the ranking it used."""

    placement: Placement
    ranking: tuple[NodeScore, ...]
    explanation: str
    predicted_seconds: float | None = None
