"""What kube-scheduler sends (``ExtenderArgs``) and what the pod asks of cachefs, parsed (the
settings a pod names: :mod:`coordinator.extender`'s docstring)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..pods import DATASET_KEY, JOB_KEY, job_id, setting, strings
from ..scheduling.registry import POLICY_NAMES

LOCALITY_KEY = "cachefs.io/locality"
POLICY_KEY = "cachefs.io/policy"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_POD_GPUS = 4096
NODE_LABEL = "cachefs.io/node"

LocalityMode = Literal["preferred", "required"]


class MalformedArgs(ValueError):
    """The body is no ExtenderArgs: no node list can be read from it."""


@dataclass(frozen=True)
class PodRequest:
    """What a pod asks of cachefs."""

    namespace: str
    name: str
    dataset: str | None
    locality: LocalityMode
    job: str | None  # the cachefs job id to look up; None when the pod names no dataset or job
    notes: tuple[str, ...] = ()  # settings that were ignored, worth one log line
    policy: str | None = None  # a policy of POLICY_NAMES whose ranking prioritize uses
    gpus: int = 1  # GPUs the pod asks for (its containers' nvidia.com/gpu), at least 1


@dataclass(frozen=True)
class ExtenderArgs:
    pod: PodRequest
    node_names: tuple[str, ...] | None  # the NodeNames form, as sent
    node_list: Mapping[str, Any] | None  # the Nodes form: the v1.NodeList as sent
    cachefs_ids: Mapping[str, str]  # kube-scheduler node name -> cachefs node id

    @property
    def candidates(self) -> list[str]:
        """Every node name of the request, in request order."""
        names = list(self.node_names or ())
        seen = set(names)
        for item in self.node_list["items"] if self.node_list else ():
            name = item["metadata"]["name"]
            if name not in seen:
                seen.add(name)
                names.append(name)
        return names


def parse_extender_args(body: bytes | str) -> ExtenderArgs:
    """Read an ExtenderArgs body; :class:`MalformedArgs` when no node list can be read."""
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise MalformedArgs(f"the body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MalformedArgs("the body is not a JSON object (ExtenderArgs)")
    pod = _field(doc, "Pod")
    if pod is not None and not isinstance(pod, dict):
        raise MalformedArgs("Pod is not an object")
    node_names = _field(doc, "NodeNames")
    if node_names is not None and not (
        isinstance(node_names, list) and all(isinstance(n, str) and n for n in node_names)
    ):
        raise MalformedArgs("NodeNames is not a list of node names")
    node_list = _field(doc, "Nodes")
    cachefs_ids = {name: name for name in node_names or ()}
    if node_list is not None:
        if not isinstance(node_list, dict):
            raise MalformedArgs("Nodes is not a NodeList object")
        # Go marshals an empty NodeList's items as null.
        items = _field(node_list, "items")
        items = [] if items is None else items
        if not isinstance(items, list):
            raise MalformedArgs("Nodes.items is not a list")
        for item in items:
            name = _node_name(item)
            if name is None:
                raise MalformedArgs("a node in Nodes.items has no metadata.name")
            labels = strings(item["metadata"].get("labels"))
            cachefs_ids[name] = labels.get(NODE_LABEL, "").strip() or name
        node_list = {**node_list, "items": items}
    if node_names is None and node_list is None:
        raise MalformedArgs("neither Nodes nor NodeNames is given")
    return ExtenderArgs(
        parse_pod(pod or {}),
        tuple(node_names) if node_names is not None else None,
        node_list,
        cachefs_ids,
    )


def parse_pod(pod: Mapping[str, Any]) -> PodRequest:
    """The dataset, locality and job a v1.Pod names (see the module's docstring)."""
    found = pod.get("metadata")
    meta: dict[str, Any] = found if isinstance(found, dict) else {}
    namespace = _text(meta.get("namespace")) or "default"
    name = _text(meta.get("name"))

    dataset = setting(meta, DATASET_KEY)
    notes = []
    wanted = (setting(meta, LOCALITY_KEY) or "preferred").lower()
    locality: LocalityMode = "required" if wanted == "required" else "preferred"
    if wanted not in ("required", "preferred"):
        notes.append(
            f"{LOCALITY_KEY}={wanted[:64]!r} is neither required nor preferred; using preferred"
        )
    policy = setting(meta, POLICY_KEY)
    if policy is not None and policy not in POLICY_NAMES:
        notes.append(f"{POLICY_KEY}={policy[:64]!r} is no known policy; scoring by cached bytes")
        policy = None
    # A job is looked up when the pod names one, or names a dataset (then it is derived).
    job = setting(meta, JOB_KEY)
    if job is None and dataset is not None:
        job = job_id(meta, namespace, name)
    return PodRequest(
        namespace, name, dataset, locality, job, tuple(notes), policy, pod_gpus(pod.get("spec"))
    )


def pod_gpus(spec: Any) -> int:
    """GPUs a v1.PodSpec asks for: the sum of its containers' ``nvidia.com/gpu`` limits (else
    requests; an extended resource's request equals its limit), at least 1."""
    total = 0
    containers = spec.get("containers") if isinstance(spec, dict) else None
    for container in containers if isinstance(containers, list) else ():
        resources = container.get("resources") if isinstance(container, dict) else None
        if not isinstance(resources, dict):
            continue
        for kind in ("limits", "requests"):
            amounts = resources.get(kind)
            value = amounts.get(GPU_RESOURCE) if isinstance(amounts, dict) else None
            # A quantity is a string ("2") or, from some clients, a number.
            if isinstance(value, int) and not isinstance(value, bool):
                total += max(0, value)
                break
            if isinstance(value, str) and value.strip().isdigit():
                total += int(value.strip())
                break
    return max(1, min(total, MAX_POD_GPUS))


def _field(obj: Mapping[str, Any], name: str) -> Any:
    """``obj[name]``, matched the way Go's encoding/json matches a field without a json tag:
    the exact key first, else any key equal under case folding."""
    if name in obj:
        return obj[name]
    folded = name.casefold()
    for key, value in obj.items():
        if key.casefold() == folded:
            return value
    return None


def _text(value: Any) -> str:
    """``value`` if it is a string, else "" (a pod's fields come as any JSON)."""
    return value if isinstance(value, str) else ""


def _node_name(item: Any) -> str | None:
    meta = item.get("metadata") if isinstance(item, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; Go's does not, and an answer echoing one (a node
    # object's field) would be no JSON to the scheduler.
    raise ValueError(f"{name} is not JSON")
