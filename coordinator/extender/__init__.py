"""The kube-scheduler extender: ``POST /scheduler/filter`` and ``POST /scheduler/prioritize``.

kube-scheduler calls an HTTP extender (``extenders:`` in its KubeSchedulerConfiguration) with an
``ExtenderArgs`` body for every pod it schedules; the wire types are those of
``k8s.io/kube-scheduler/extender/v1`` (``types.go``). They carry no json tags, so the keys are
the Go field names: ``{"Pod": {v1.Pod}, "Nodes": {v1.NodeList} | null, "NodeNames": [..] |
null}``. With ``nodeCacheCapable: true`` it sends ``NodeNames`` and reads ``NodeNames`` back;
with ``false`` it sends ``Nodes`` and reads ``Nodes`` back. An answer without the list the
scheduler reads leaves the pod with no node at all, so every answer repeats the form (or both
forms) of its request. Go's decoder matches keys case-insensitively, so ``pod``/``nodeNames``
from other clients are accepted too; answers use the exact Go names.

What a pod asks for (labels or annotations; an annotation wins when both are set, since it is
the free-form, per-pod setting, while a label may be kept for selectors):

- ``cachefs.io/dataset``: the dataset it reads. Pods without it pass untouched (every pod of
  the cluster comes through an extender that manages no resources, so this path takes no lock).
- ``cachefs.io/locality``: ``preferred`` (default) only scores; ``required`` also filters out
  nodes that hold none of the dataset.
- ``cachefs.io/policy``: a placement policy (``GET /v1/placement/policies``) whose node ranking
  prioritize uses instead of cached bytes alone (see below); an unknown name is logged once and
  ignored.
- ``cachefs.io/job``: the id of the cachefs job (``POST /v1/jobs``) the pod belongs to. Without
  it the id is ``<namespace>.<owner>``: the owner is the Job controller's ``job-name`` label,
  else the controlling owner reference, else the pod itself. cachefs job ids are cluster-wide
  and Kubernetes names are per namespace; a namespace never holds a ``.``, so the id is
  unambiguous.

Node identity: a kube-scheduler node name is the cachefs node id (the DaemonSet runs the worker
with ``--node $(NODE_NAME)``); a node object labelled ``cachefs.io/node`` maps to that id
instead, which only works with ``nodeCacheCapable: false`` (names alone carry no labels).

Answers:

- **filter**: a pod whose cachefs job is *suspended* (the CacheManager queued it) fails on every
  node with the queue position and why, so it stays Pending with that reason and kube-scheduler
  retries it; once the job is promoted the next attempt passes. ``required`` locality fails the
  nodes that hold none of the dataset, even when that fails them all: required means "never run
  this reading from the object store", and a Pending pod whose event says "holds none of dataset
  X" tells the user to preload, where a silent fallback would hide it. Failed nodes are listed
  in ``FailedAndUnresolvableNodes`` (preempting other pods cannot make a node hold a dataset or
  promote a job; kube-scheduler ≥ 1.20 then skips preemption) and in ``FailedNodes`` (what
  older schedulers read); the reason is the same text for every node so that the pod's event
  reads "3 cachefs: …" instead of listing nodes.
- **prioritize**: 0..10 (``MaxExtenderPriority``) from each node's cached bytes of the dataset,
  relative to the node holding the most (which scores 10; any cached byte scores at least 1).
  kube-scheduler multiplies by the extender's ``weight``, so the weight alone says how much
  locality counts. A *running* job's copy comes first, as in TDCS: the copy's nodes score 5..10
  and the others 0..4, each band by cached bytes. With ``cachefs.io/policy`` the nodes are
  ranked by that policy's ``place()`` for a job of the pod's GPUs (``nvidia.com/gpu`` limits
  of its containers, at least 1) reading the dataset, on the coordinator's nodes with all their
  GPUs free (kube-scheduler, not the extender, knows what is allocated): the policy's best
  nodes score 10, each lower distinct score one step less (never below 1), nodes it does not
  rank (no cachefs worker, no GPUs) 0. A policy that cannot rank (P4 without node hardware, a
  job that fits nowhere) falls back to the cached-bytes scores, logged once.
- Pods without a dataset, unknown datasets, unregistered jobs and any internal error pass every
  node (filter) and score 0 (prioritize): cachefs never blocks scheduling, and each such case
  is logged once. A body that is no ExtenderArgs at all cannot be passed through (the node list
  is unknown): filter answers ``Error`` (kube-scheduler skips an ``ignorable`` extender whose
  answer has one, and logs the message), prioritize answers an empty list (prioritize errors
  never fail scheduling). The status is 200 either way: a non-200 reaches the scheduler's log
  only as a status code.

The routes need no bearer token: kube-scheduler's extender client sends none (its config has
no header settings). They only read: filter never registers a job, since kube-scheduler calls
it on every scheduling attempt of every pod and never says when a pod ends, so a job
registered here would hold its copy's slot until its lease ran out. Jobs are registered by
whoever launches them (``POST /v1/jobs``). Anyone who can reach the coordinator can learn
from them which nodes hold a dataset (relative scores) and whether a job they name is queued;
a NetworkPolicy limits who that is, where it matters.

Three modules: :mod:`.request` parses what kube-scheduler sends and what the pod asks;
:mod:`.decide` holds the decisions, pure functions of the parsed request and a snapshot (the
locality document of the dataset, the job's status), and :class:`~.decide.Extender`, which
takes the snapshot; :mod:`.http` is the HTTP layer (:func:`~.http.extender_router`). Parsing,
the model's lock and JSON encoding run in a worker thread, never on the event loop.
"""

from __future__ import annotations

from .http import extender_router

__all__ = ["extender_router"]
