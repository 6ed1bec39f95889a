"""Policies by name, as the simulator and the placement endpoint ask for them."""

from __future__ import annotations

from collections.abc import Callable

from .baselines import FifoPolicy, RandomPolicy
from .elastic import EarliestFinishPolicy, ElasticPolicy
from .model import SchedulingError
from .policy import Policy
from .qos import CapacityPolicy, MinMinPolicy, QosPolicy, TetrisPolicy, WeightedFairPolicy
from .roofline import RooflinePolicy
from .tdcs import TdcsPolicy
from .themis import LasPolicy, ThemisPolicy

# name -> factory(locality, seed). Every policy with a time model or a placement preference
# also exists as "<name>+locality"; TDCS is a locality policy by construction.
_FACTORIES: dict[str, Callable[[bool, int], Policy]] = {
    "fifo": lambda loc, _seed: FifoPolicy(locality=loc),
    "random": lambda loc, seed: RandomPolicy(locality=loc, seed=seed),
    "p2-elastic": lambda loc, _seed: ElasticPolicy(locality=loc),
    "p2-earliest-finish": lambda loc, _seed: EarliestFinishPolicy(locality=loc),
    "p3-qos": lambda loc, _seed: QosPolicy(locality=loc),
    "capacity": lambda loc, _seed: CapacityPolicy(locality=loc),
    "weighted-fair": lambda loc, _seed: WeightedFairPolicy(locality=loc),
    "min-min": lambda loc, _seed: MinMinPolicy(locality=loc),
    "tetris+perf": lambda loc, _seed: TetrisPolicy(locality=loc, term="perf"),
    "tetris+cer": lambda loc, _seed: TetrisPolicy(locality=loc, term="cer"),
    "p4-roofline": lambda loc, _seed: RooflinePolicy(locality=loc),
    "p5-themis": lambda loc, _seed: ThemisPolicy(locality=loc),
    "tiresias-las": lambda loc, _seed: LasPolicy(locality=loc),
}
_LOCALITY_ONLY: dict[str, Callable[[int], Policy]] = {
    "tdcs": lambda _seed: TdcsPolicy(overflow="suspend"),
    "tdcs-clone": lambda _seed: TdcsPolicy(overflow="clone"),
}
LOCALITY_SUFFIX = "+locality"

POLICY_NAMES: tuple[str, ...] = tuple(
    sorted([*_FACTORIES, *(name + LOCALITY_SUFFIX for name in _FACTORIES), *_LOCALITY_ONLY])
)


def make_policy(name: str, *, seed: int = 0) -> Policy:
    """A fresh policy called ``name`` (one of :data:`POLICY_NAMES`)."""
    if name in _LOCALITY_ONLY:
        return _LOCALITY_ONLY[name](seed)
    base, locality = name, False
    if name.endswith(LOCALITY_SUFFIX):
        base, locality = name[: -len(LOCALITY_SUFFIX)], True
    if base not in _FACTORIES:
        raise SchedulingError(
            f"unknown placement policy {name!r}; known policies: {', '.join(POLICY_NAMES)}"
        )
    return _FACTORIES[base](locality, seed)
