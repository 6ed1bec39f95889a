"""Locality-aware GPU job placement policies (P1–P5) behind one small interface.

See ``docs/scheduling.md`` for the policies, the choices made where the papers are silent, and
the placement endpoint.
"""

from .model import (
    Clone,
    ClusterState,
    Dataset,
    Decision,
    IoBandwidth,
    JobSpec,
    JobState,
    ModelProfile,
    Node,
    NodeScore,
    Placement,
    PlacementChoice,
    QosClass,
    Resize,
    SchedulingError,
    Start,
    Wait,
)
from .policy import Policy
from .registry import POLICY_NAMES, make_policy

__all__ = [
    "POLICY_NAMES",
    "Clone",
    "ClusterState",
    "Dataset",
    "Decision",
    "IoBandwidth",
    "JobSpec",
    "JobState",
    "ModelProfile",
    "Node",
    "NodeScore",
    "Placement",
    "PlacementChoice",
    "Policy",
    "QosClass",
    "Resize",
    "SchedulingError",
    "Start",
    "Wait",
    "make_policy",
]
