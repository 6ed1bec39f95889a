"""The CacheScaler: grows and shrinks a dataset's cached copies on Kubernetes.

``python -m coordinator.scaler --coordinator URL --token-file F`` runs as its own Deployment.
It is a client of the coordinator's HTTP API (``POST /v1/datasets/{d}/copies/{c}/scale``,
through :class:`cachefs.client.CoordinatorClient`) and of the Kubernetes API (the ``kubernetes``
package): it imports nothing of the coordinator's internals. Two triggers share one reconcile
loop (:mod:`.controller`); every decision is a pure function (:mod:`.decide`).

**Event trigger.** Training pods name their dataset with the annotation (or label)
``cachefs.io/dataset``, and optionally the copy they read with ``cachefs.io/copy``. Otherwise
the copy of their cachefs job (``POST /v1/jobs``) is used, the job id being ``cachefs.io/job``
or derived from the pod's owner as the scheduler extender derives it
(``<namespace>.<Job name>``); with no such job running they read the dataset's primary (first)
copy. A pod counts while it holds a node: ``spec.nodeName``
set, phase not Succeeded/Failed, no ``deletionTimestamp``. For a node running such a pod:

1. the node gets the label ``cachefs.io/worker=true`` (the worker DaemonSet's nodeSelector), so
   a worker starts there; the scaler marks it ``cachefs.io/scaler-labeled=true``;
2. once that worker is up at the coordinator (cachefs node id = Kubernetes node name), the node
   joins the pod's copy — unless it already belongs to a copy of the dataset. Until then the
   scaler retries on every pass (the API would answer 404 NodeNotFound);
3. when the node has run none of the copy's pods for ``--release-grace``, it leaves the copy;
4. once no copy of any dataset includes it, no hand-off reads from it and no cachefs training
   pod runs there, its label (if the scaler set it) comes off and the worker stops.

**Metric trigger.** Every ``--metric-interval`` the scaler samples each copy's cache used
ratio (used / capacity over its live nodes: the coordinator's ``cachefs_cache_used_ratio``).
When every sample over ``--metric-window`` is above ``--metric-high``, the copy gains one node:
a node with the worker label and an up worker outside every copy of the dataset (nodes running
the dataset's pods first, then the most free cache). When every sample is below
``--metric-low``, it loses one node the metric trigger added that runs none of the dataset's
pods, the one holding the fewest cached bytes. After each action the window starts over and
no sample counts for ``--metric-cooldown``. ``--metric-high 1 --metric-low 0`` switches the
trigger off (a ratio is never above 1 nor below 0).

**How they compose.** Each node records which copies the scaler added it to and which trigger
did, in the annotation ``cachefs.io/scaler-added`` (``imagenet/A=event,coco/B=metric``; on the
node so a restarted scaler knows). A trigger removes only nodes it added itself: the event
trigger never removes a node the metric trigger added, nor one an operator added; the metric
trigger never removes a node running the dataset's pods. Both respect ``--min-nodes`` and
``--max-nodes`` per copy. One scale call per copy and pass carries both triggers' changes; while
an earlier hand-off of the copy still runs the coordinator answers 409 (CopyBusy) and the call
is retried on a later pass. Copies spanning every node (a dataset added without ``nodes``) are
left as they are: every registered node is already in them, so their workers keep their label.
"""
