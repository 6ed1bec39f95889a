"""What a Kubernetes pod tells cachefs, read the same way by the scheduler extender
(``coordinator.extender``) and the CacheScaler (``coordinator.scaler``). Pure functions over a
v1.Pod's ``metadata`` (a JSON mapping); this module imports nothing of the coordinator, so the
scaler, which runs as its own process, may use it.

A pod names its settings with annotations or labels of the same key; the annotation wins, since
it is the free-form, per-pod setting while a label may be kept for selectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The cachefs dataset the pod reads.
DATASET_KEY = "cachefs.io/dataset"
#: The pod's cachefs job id (``POST /v1/jobs``); without it the id is derived (:func:`job_id`).
JOB_KEY = "cachefs.io/job"
#: The Job controller's labels naming a pod's Job (the prefixed one since Kubernetes 1.27).
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")


def strings(value: Any) -> dict[str, str]:
    """A label or annotation map, without entries that are not strings."""
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, str)}


def setting(meta: Mapping[str, Any], key: str) -> str | None:
    """The annotation ``key``, else the label ``key``, stripped; None when neither is set."""
    for source in (meta.get("annotations"), meta.get("labels")):
        value = strings(source).get(key, "").strip()
        if value:
            return value
    return None


def job_id(meta: Mapping[str, Any], namespace: str, name: str) -> str | None:
    """The pod's cachefs job id: ``cachefs.io/job``, else ``<namespace>.<owner>`` where the
    owner is the Job controller's job-name label, else the controlling owner reference, else the
    pod itself (None for a pod with none of these). cachefs job ids are cluster-wide and
    Kubernetes names are per namespace; a namespace never holds a ``.``, so the id is
    unambiguous."""
    explicit = setting(meta, JOB_KEY)
    if explicit is not None:
        return explicit
    labels = strings(meta.get("labels"))
    owner = next((labels[k].strip() for k in JOB_NAME_LABELS if labels.get(k, "").strip()), "")
    owner = owner or _controller_name(meta) or name
    return f"{namespace or 'default'}.{owner}" if owner else None


def _controller_name(meta: Mapping[str, Any]) -> str:
    refs = meta.get("ownerReferences")
    for ref in refs if isinstance(refs, list) else ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            name = ref.get("name")
            return name if isinstance(name, str) else ""
    return ""
