"""What a simulation runs on and what it runs: cluster, datasets, preloads, traces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.scheduling.model import IoBandwidth, JobSpec

CACHE_MODES = ("none", "static", "follow")


class SimulationError(RuntimeError):
    """The simulation cannot go on: bad input or a policy that broke the rules."""


@dataclass(frozen=True)
class NodeSpec:
    """One GPU node: GPUs, cache capacity (bytes) and, for P4, hardware facts."""

    name: str
    gpus: int
    cache_bytes: int = 0
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    network_bits_per_s: float | None = None
    overhead_s: float = 0.0


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    size: int
    samples: int

    @property
    def sample_bytes(self) -> float:
        return self.size / self.samples


@dataclass(frozen=True)
class Preload:
    """P1's Preloader: load ``fraction`` of ``dataset`` into a copy starting at time ``at``.

    ``nodes`` names the copy's nodes (a new copy when no existing copy has exactly these
    nodes); None = the dataset's first copy.
    """

    dataset: str
    at: float = 0.0
    fraction: float = 1.0
    nodes: frozenset[str] | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster.

    ``cache_mode``: ``none`` (every read goes to the store), ``static`` (each dataset's copies
    are fixed: ``static_copies``, default one copy striped over every node) or ``follow``
    (P1's CacheScaler: a copy grows to the nodes of the jobs that read it; the first job
    creates it).
    """

    nodes: tuple[NodeSpec, ...]
    io: IoBandwidth = field(default_factory=IoBandwidth)
    cache_mode: str = "follow"
    static_copies: Mapping[str, tuple[frozenset[str], ...]] = field(default_factory=dict)
    #: seconds a job is stopped when it is rescaled or resumed (checkpoint and restart).
    restart_s: float = 10.0
    #: multiplicative noise on the epoch times jobs report (P2 fits them).
    observation_noise: float = 0.02
    seed: int = 0
    #: each node's network link, bytes/s each way; None keeps the per-copy peer model of
    #: ``IoBandwidth.peer_per_node``. When set, a read of a shard cached on another node crosses
    #: the reader's inbound link and the holder's outbound link, a store read the reader's
    #: inbound link, and multi-node jobs' gradient exchange takes its share of both (see
    #: ``engine``); co-located reads (the shard on the reader's own node) cross no link.
    nic_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise SimulationError(
                f"cache_mode {self.cache_mode!r} is not one of {', '.join(CACHE_MODES)}"
            )
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names) or not names:
            raise SimulationError("a cluster needs at least one node and unique node names")


def uniform_cluster(
    nodes: int,
    gpus_per_node: int,
    *,
    cache_bytes: int = 0,
    io: IoBandwidth | None = None,
    cache_mode: str = "follow",
    **options: object,
) -> ClusterConfig:
    """``nodes`` identical nodes called node00, node01, ..."""
    specs = tuple(NodeSpec(f"node{i:02d}", gpus_per_node, cache_bytes) for i in range(nodes))
    return ClusterConfig(specs, io or IoBandwidth(), cache_mode, **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Trace:
    """Jobs (any order; sorted by arrival when run), their datasets, and preloads."""

    jobs: tuple[JobSpec, ...]
    datasets: Mapping[str, DatasetSpec] = field(default_factory=dict)
    preloads: tuple[Preload, ...] = ()
