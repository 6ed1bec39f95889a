"""The CacheScaler's decisions (pure functions, no cluster): which pods count, which copy they
read, what each trigger adds and removes, hysteresis, cooldown, bounds, and when a node's worker
label may be set or removed."""

from __future__ import annotations

import pytest

from coordinator.scaler.decide import (
    ADDED_KEY,
    EVENT,
    LABELED_KEY,
    METRIC,
    SCALE_IN,
    SCALE_OUT,
    WORKER_LABEL,
    CopyView,
    KubeNode,
    Limits,
    MetricHistory,
    TrainingPod,
    WorkerView,
    add_sample,
    copies_of,
    copy_for,
    format_added,
    job_copies,
    kube_node,
    metric_verdict,
    parse_added,
    plan,
    pods_per_copy,
    record_action,
    scale_in_node,
    scale_out_node,
    track_idle,
    training_pod,
    workers_of,
)

# --- builders ------------------------------------------------------------------------------------


def pod_obj(node="n1", *, phase="Running", annotations=None, labels=None, deleting=False):
    meta = {"name": "p", "namespace": "ns", "annotations": annotations, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {"nodeName": node} if node else {}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def tpod(node, dataset="ds", copy=None, job=None, name="p"):
    return TrainingPod("ns", name, node, dataset, copy, job)


def view(nodes, dataset="ds", copy="A", ratio=0.0, fill_nodes=(), filling=False):
    return CopyView(dataset, copy, frozenset(nodes), ratio, frozenset(fill_nodes), filling)


def knode(name, *, labeled=True, by_scaler=False, added=None):
    return KubeNode(name, labeled, by_scaler, dict(added or {}))


def workers(*up, down=(), free=None, cached=None):
    result = {n: WorkerView(True, (free or {}).get(n, 0), (cached or {}).get(n, {})) for n in up}
    result.update({n: WorkerView(False) for n in down})
    return result


def make_plan(**kwargs):
    defaults = dict(
        pods=[],
        copies={},
        jobs={},
        kube_nodes={},
        workers={},
        idle_since={},
        metric={},
        limits=Limits(),
        now=100.0,
    )
    defaults.update(kwargs)
    return plan(**defaults)


# --- pods ----------------------------------------------------------------------------------------


def test_running_pod_with_dataset_annotation_counts():
    pod = training_pod(pod_obj("n7", annotations={"cachefs.io/dataset": " imagenet "}))
    assert pod == TrainingPod("ns", "p", "n7", "imagenet", None, "ns.p")


def test_job_id_is_named_or_derived_from_the_owner_as_the_extender_does():
    ds = {"cachefs.io/dataset": "ds"}
    named = pod_obj(annotations={**ds, "cachefs.io/job": "train-42"}, labels={"job-name": "x"})
    assert training_pod(named).job == "train-42"
    by_job = pod_obj(
        annotations=ds, labels={"batch.kubernetes.io/job-name": "resnet", "job-name": "old"}
    )
    assert training_pod(by_job).job == "ns.resnet"
    owned = pod_obj(annotations=ds)
    owned["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "other", "controller": False},
        {"kind": "StatefulSet", "name": "trainer", "controller": True},
    ]
    assert training_pod(owned).job == "ns.trainer"
    owned["metadata"]["namespace"] = ""
    assert training_pod(owned).job == "default.trainer"


def test_dataset_label_counts_and_annotation_wins_over_label():
    assert training_pod(pod_obj(labels={"cachefs.io/dataset": "coco"})).dataset == "coco"
    both = pod_obj(
        annotations={"cachefs.io/dataset": "imagenet", "cachefs.io/copy": "B"},
        labels={"cachefs.io/dataset": "coco", "cachefs.io/copy": "C", "cachefs.io/job": "j1"},
    )
    pod = training_pod(both)
    assert (pod.dataset, pod.copy, pod.job) == ("imagenet", "B", "j1")


@pytest.mark.parametrize(
    "obj",
    [
        pod_obj(node=None, phase="Pending", annotations={"cachefs.io/dataset": "ds"}),
        pod_obj(phase="Succeeded", annotations={"cachefs.io/dataset": "ds"}),
        pod_obj(phase="Failed", annotations={"cachefs.io/dataset": "ds"}),
        pod_obj(deleting=True, annotations={"cachefs.io/dataset": "ds"}),
        pod_obj(annotations={"other": "x"}),
        pod_obj(annotations={"cachefs.io/dataset": ""}),
    ],
    ids=["unscheduled", "succeeded", "failed", "terminating", "no-dataset", "empty-dataset"],
)
def test_pods_that_hold_no_node_or_name_no_dataset_do_not_count(obj):
    assert training_pod(obj) is None


def test_pending_pod_bound_to_a_node_counts():
    """Its node needs the worker before the pod's containers can read."""
    obj = pod_obj("n3", phase="Pending", annotations={"cachefs.io/dataset": "ds"})
    assert training_pod(obj).node == "n3"


def test_pod_without_status_or_spec_sections():
    assert training_pod({"metadata": {"annotations": {"cachefs.io/dataset": "ds"}}}) is None


# --- the coordinator's documents -----------------------------------------------------------------


def test_copies_of_reads_nodes_ratio_and_running_fill():
    docs = [
        {
            "name": "ds",
            "copies": [
                {"id": "A", "nodes": ["n1", "n2"], "used_ratio": 0.25, "fill": None},
                {
                    "id": "B",
                    "nodes": ["n3"],
                    "used_ratio": 0.5,
                    "fill": {"id": "B-2", "sources": ["n1"], "leaving": ["n4"]},
                },
            ],
        }
    ]
    copies = copies_of(docs)
    a, b = copies["ds"]
    assert (a.key, a.nodes, a.used_ratio, a.filling) == (("ds", "A"), {"n1", "n2"}, 0.25, False)
    assert (b.key, b.fill_nodes, b.filling) == (("ds", "B"), {"n1", "n4"}, True)


def test_workers_of_reads_state_free_cache_and_cached_bytes():
    docs = [
        {
            "node": "n1",
            "state": "up",
            "tiers": [{"capacity": 100, "used": 30}, {"capacity": 50, "used": 50}],
            "datasets": [{"dataset": "ds", "cached_bytes": 7}],
        },
        {"node": "n2", "state": "down", "tiers": [], "datasets": []},
    ]
    result = workers_of(docs)
    assert result["n1"] == WorkerView(True, 70, {"ds": 7})
    assert result["n2"].up is False


def test_job_copies_only_running_jobs_with_a_copy():
    jobs = [
        {"id": "j1", "dataset": "ds", "copy": "B", "state": "running"},
        {"id": "j2", "dataset": "ds", "copy": None, "state": "suspended"},
    ]
    assert job_copies(jobs) == {"j1": ("ds", "B")}


# --- ownership records on nodes ------------------------------------------------------------------


def test_added_annotation_round_trips_and_drops_garbage():
    owned = {("imagenet", "A"): EVENT, ("coco", "B2"): METRIC}
    text = format_added(owned)
    assert text == "coco/B2=metric,imagenet/A=event"
    assert parse_added(text) == owned
    assert parse_added("x, /A=event, ds/=event, ds/A=other, ds/B=metric") == {("ds", "B"): METRIC}
    assert format_added({}) is None  # remove the annotation
    assert parse_added(None) == {}


def test_kube_node_reads_label_and_annotations():
    obj = {
        "metadata": {
            "name": "n1",
            "labels": {WORKER_LABEL: "true"},
            "annotations": {LABELED_KEY: "true", ADDED_KEY: "ds/A=event"},
        }
    }
    assert kube_node(obj) == KubeNode("n1", True, True, {("ds", "A"): EVENT})
    other = kube_node({"metadata": {"name": "n2", "labels": {WORKER_LABEL: "false"}}})
    assert (other.labeled, other.labeled_by_scaler, other.added) == (False, False, {})


# --- which copy a pod reads ----------------------------------------------------------------------


def test_copy_for_prefers_named_copy_then_job_then_primary():
    copies = {"ds": [view([], copy="A"), view([], copy="B"), view([], copy="C")]}
    jobs = {"j1": ("ds", "C"), "other": ("ds2", "A")}
    assert copy_for(tpod("n1", copy="B", job="j1"), copies, jobs) == ("ds", "B")
    assert copy_for(tpod("n1", copy="Z", job="j1"), copies, jobs) == ("ds", "C")
    assert copy_for(tpod("n1", job="other"), copies, jobs) == ("ds", "A")  # another dataset's
    assert copy_for(tpod("n1", job="gone"), copies, jobs) == ("ds", "A")
    assert copy_for(tpod("n1", dataset="unknown"), copies, jobs) is None


def test_pods_per_copy_counts_pods_per_node():
    copies = {"ds": [view([], copy="A"), view([], copy="B")]}
    pods = [tpod("n1"), tpod("n1", name="q"), tpod("n2", copy="B"), tpod("n3", dataset="x")]
    assert pods_per_copy(pods, copies, {}) == {("ds", "A"): {"n1": 2}, ("ds", "B"): {"n2": 1}}


# --- idle tracking -------------------------------------------------------------------------------


def test_track_idle_keeps_the_first_time_and_restarts_when_pods_return():
    copies = {"ds": [view(["n1", "n2", "n3"])]}
    nodes = {
        "n1": knode("n1", added={("ds", "A"): EVENT}),
        "n2": knode("n2", added={("ds", "A"): EVENT}),
        "n3": knode("n3", added={("ds", "A"): METRIC}),  # the metric trigger's: not tracked
        "n4": knode("n4", added={("ds", "A"): EVENT}),  # not in the copy: not tracked
    }
    idle = track_idle({}, nodes, copies, {("ds", "A"): {"n2": 1}}, now=10.0)
    assert idle == {("n1", ("ds", "A")): 10.0}
    idle = track_idle(idle, nodes, copies, {}, now=20.0)
    assert idle == {("n1", ("ds", "A")): 10.0, ("n2", ("ds", "A")): 20.0}
    idle = track_idle(idle, nodes, copies, {("ds", "A"): {"n1": 1}}, now=30.0)
    assert idle == {("n2", ("ds", "A")): 20.0}


# --- the metric trigger --------------------------------------------------------------------------

WINDOW = dict(window_s=10.0, high=0.9, low=0.5, cooldown_s=5.0)


def history(*samples, last_action_at=None):
    h = MetricHistory(last_action_at=last_action_at)
    for at, ratio in samples:
        add_sample(h, at, ratio, WINDOW["window_s"])
    return h


def test_add_sample_keeps_the_window_and_one_sample_before_it():
    h = history((0, 0.1), (4, 0.2), (8, 0.3), (12, 0.4), (16, 0.5))
    # Window start 6: (4, 0.2) is the newest sample at or before it and shows the ratio then.
    assert h.samples == [(4, 0.2), (8, 0.3), (12, 0.4), (16, 0.5)]


def test_no_verdict_before_a_whole_window_was_watched():
    h = history((0, 0.95), (5, 0.95), (9, 0.99))
    assert metric_verdict(h, 9.0, **WINDOW) is None
    add_sample(h, 10.0, 0.97, 10.0)
    assert metric_verdict(h, 10.0, **WINDOW) == SCALE_OUT


def test_scale_in_when_every_sample_of_the_window_is_low():
    h = history((0, 0.1), (5, 0.2), (10, 0.45))
    assert metric_verdict(h, 10.0, **WINDOW) == SCALE_IN


@pytest.mark.parametrize(
    "ratios",
    [(0.95, 0.95, 0.85), (0.95, 0.9, 0.95), (0.4, 0.6, 0.4), (0.5, 0.4, 0.4), (0.7, 0.7, 0.7)],
    ids=["dip-below-high", "equal-high", "blip-above-low", "equal-low", "between"],
)
def test_hysteresis_one_sample_outside_the_band_prevents_the_action(ratios):
    h = history(*zip((0, 5, 10), ratios, strict=True))
    assert metric_verdict(h, 10.0, **WINDOW) is None


def test_a_dip_that_left_the_window_no_longer_counts():
    h = history((0, 0.5), (5, 0.95), (10, 0.95), (15, 0.95))
    assert metric_verdict(h, 15.0, **WINDOW) == SCALE_OUT


def test_after_an_action_the_window_starts_over_after_the_cooldown():
    h = history((0, 0.95), (10, 0.95))
    assert metric_verdict(h, 10.0, **WINDOW) == SCALE_OUT
    record_action(h, 10.0)
    assert h.samples == []
    for at in (12, 14, 16, 20, 24):  # the first two fall in the cooldown (until 15)
        add_sample(h, at, 0.99, 10.0)
        assert metric_verdict(h, at, **WINDOW) is None, at
    add_sample(h, 26, 0.99, 10.0)  # the window [16, 26] now lies wholly after the cooldown
    assert h.samples[0] == (16, 0.99)
    assert metric_verdict(h, 26.0, **WINDOW) == SCALE_OUT


def test_cooldown_blocks_even_a_full_window():
    h = history((0, 0.95), (10, 0.95), last_action_at=8.0)
    assert metric_verdict(h, 10.0, **WINDOW) is None


def test_scale_out_node_prefers_pods_then_free_cache_then_name():
    copies = {"ds": [view(["n1"]), view(["n2"], copy="B")], "other": [view(["n5"], "other")]}
    nodes = {n: knode(n) for n in ("n1", "n2", "n3", "n4", "n5", "n6", "n7")}
    nodes["n6"] = knode("n6", labeled=False)
    ws = workers(
        "n1", "n2", "n3", "n4", "n5", "n6", down=("n7",), free={"n3": 5, "n4": 9, "n5": 1, "n6": 99}
    )
    key = ("ds", "A")
    assert scale_out_node(key, copies, nodes, ws, {}) == "n4"  # most free; n6 has no label
    assert scale_out_node(key, copies, nodes, ws, {"n5": 2}) == "n5"  # runs the dataset's pods
    assert scale_out_node(key, copies, nodes, ws, {}, exclude=["n4"]) == "n3"
    ws["n3"] = ws["n4"] = ws["n5"] = WorkerView(True, 0)
    assert scale_out_node(key, copies, nodes, ws, {}) == "n3"  # ties by name
    assert scale_out_node(key, copies, {"n1": nodes["n1"]}, ws, {}) is None


def test_scale_in_node_only_metric_added_idle_nodes_least_cached_first():
    v = view(["n1", "n2", "n3", "n4", "n5"])
    nodes = {
        "n1": knode("n1"),  # an operator's
        "n2": knode("n2", added={("ds", "A"): METRIC}),
        "n3": knode("n3", added={("ds", "A"): METRIC}),
        "n4": knode("n4", added={("ds", "A"): EVENT}),
        "n5": knode("n5", added={("ds", "A"): METRIC}),
    }
    ws = workers("n1", "n2", "n3", "n4", "n5", cached={"n2": {"ds": 50}, "n3": {"ds": 10}})
    assert scale_in_node(v, nodes, ws, {"n5": 1}) == "n3"  # n5 runs the dataset's pods
    assert scale_in_node(v, nodes, ws, {"n5": 1}, exclude=["n3"]) == "n2"
    assert scale_in_node(v, nodes, ws, {"n2": 1, "n3": 1, "n5": 1}) is None


# --- the plan: event trigger ---------------------------------------------------------------------


def test_pod_on_a_new_node_labels_it_and_adds_it_once_its_worker_is_up():
    copies = {"ds": [view(["n1"])]}
    nodes = {"n1": knode("n1"), "n2": knode("n2", labeled=False)}
    before = make_plan(pods=[tpod("n2")], copies=copies, kube_nodes=nodes, workers=workers("n1"))
    assert before.label == ["n2"]
    assert before.changes == []  # its worker has not registered: wait
    assert any("n2 waits for its cachefs worker" in w for w in before.waiting)

    nodes["n2"] = knode("n2", by_scaler=True)
    after = make_plan(
        pods=[tpod("n2")], copies=copies, kube_nodes=nodes, workers=workers("n1", "n2")
    )
    assert after.label == []
    [change] = after.changes
    assert (change.key, change.add, change.remove) == (("ds", "A"), {"n2": EVENT}, [])
    assert after.unlabel == []


def test_down_worker_is_not_added():
    plan_ = make_plan(
        pods=[tpod("n2")],
        copies={"ds": [view(["n1"])]},
        kube_nodes={"n1": knode("n1"), "n2": knode("n2")},
        workers=workers("n1", down=("n2",)),
    )
    assert plan_.changes == []


def test_pods_of_unknown_datasets_and_bad_node_names_change_nothing():
    long_name = "n" * 70
    plan_ = make_plan(
        pods=[tpod("n2", dataset="nope"), tpod(long_name)],
        copies={"ds": [view(["n1"])]},
        kube_nodes={
            "n1": knode("n1"),
            "n2": knode("n2", labeled=False),
            long_name: knode(long_name, labeled=False),
        },
        workers=workers("n1", "n2", long_name),
    )
    assert plan_.label == [] and plan_.changes == []
    assert any("not a valid cachefs node name" in w for w in plan_.waiting)


def test_node_already_in_another_copy_of_the_dataset_is_not_added():
    copies = {"ds": [view(["n1"], copy="A"), view(["n2"], copy="B")]}
    plan_ = make_plan(
        pods=[tpod("n2", copy="A")],
        copies=copies,
        kube_nodes={"n1": knode("n1"), "n2": knode("n2")},
        workers=workers("n1", "n2"),
    )
    assert plan_.changes == []


def test_a_node_joins_one_copy_of_a_dataset_even_with_pods_of_two():
    copies = {"ds": [view(["n1"], copy="A"), view(["n2"], copy="B")]}
    plan_ = make_plan(
        pods=[tpod("n3", copy="A"), tpod("n3", copy="B", name="q")],
        copies=copies,
        kube_nodes={n: knode(n) for n in ("n1", "n2", "n3", "n4")},
        workers=workers("n1", "n2", "n3", "n4"),
        metric={("ds", "B"): SCALE_OUT},
    )
    assert [(c.key, c.add) for c in plan_.changes] == [
        (("ds", "A"), {"n3": EVENT}),
        (("ds", "B"), {"n4": METRIC}),  # neither n3 again nor a node of copy A
    ]


def test_pod_with_job_annotation_joins_the_jobs_copy():
    copies = {"ds": [view(["n1"], copy="A"), view(["n2"], copy="B")]}
    plan_ = make_plan(
        pods=[tpod("n3", job="j1")],
        copies=copies,
        jobs={"j1": ("ds", "B")},
        kube_nodes={n: knode(n) for n in ("n1", "n2", "n3")},
        workers=workers("n1", "n2", "n3"),
    )
    [change] = plan_.changes
    assert (change.key, change.add) == (("ds", "B"), {"n3": EVENT})


def test_event_removes_only_its_own_idle_nodes_after_the_grace_period():
    copies = {"ds": [view(["n1", "n2", "n3", "n4"])]}
    nodes = {
        "n1": knode("n1"),  # an operator added it
        "n2": knode("n2", added={("ds", "A"): EVENT}),
        "n3": knode("n3", added={("ds", "A"): METRIC}),
        "n4": knode("n4", added={("ds", "A"): EVENT}),  # still runs a pod
    }
    kwargs = dict(pods=[tpod("n4")], copies=copies, kube_nodes=nodes, workers=workers(*nodes))
    idle = {("n2", ("ds", "A")): 50.0}
    early = make_plan(**kwargs, idle_since=idle, limits=Limits(release_grace_s=60), now=100.0)
    assert early.changes == []
    late = make_plan(**kwargs, idle_since=idle, limits=Limits(release_grace_s=60), now=110.0)
    [change] = late.changes
    assert (change.add, change.remove) == ({}, ["n2"])


def test_min_nodes_and_the_api_floor_of_one_node_keep_removals_back():
    nodes = {n: knode(n, added={("ds", "A"): EVENT}) for n in ("n1", "n2", "n3")}
    copies = {"ds": [view(["n1", "n2", "n3"])]}
    kwargs = dict(copies=copies, kube_nodes=nodes, workers=workers(*nodes))
    floor_one = make_plan(**kwargs, limits=Limits(min_nodes=0))
    assert [sorted(c.remove) for c in floor_one.changes] == [["n1", "n2"]]
    floor_two = make_plan(**kwargs, limits=Limits(min_nodes=2))
    assert [c.remove for c in floor_two.changes] == [["n1"]]
    assert any("--min-nodes" in w for w in floor_two.waiting)


def test_max_nodes_keeps_the_nodes_with_most_pods():
    pods = [tpod("n2"), tpod("n3", name="a"), tpod("n3", name="b"), tpod("n4")]
    plan_ = make_plan(
        pods=pods,
        copies={"ds": [view(["n1"])]},
        kube_nodes={n: knode(n) for n in ("n1", "n2", "n3", "n4")},
        workers=workers("n1", "n2", "n3", "n4"),
        limits=Limits(max_nodes=3),
    )
    [change] = plan_.changes
    assert change.add == {"n3": EVENT, "n2": EVENT}  # n4 ties with n2 on pods, loses on name
    assert sorted(change.reasons) == ["n2", "n3"]


# --- the plan: metric trigger and how the triggers compose ---------------------------------------


def test_metric_scale_out_joins_the_event_additions_in_one_change():
    nodes = {n: knode(n) for n in ("n1", "n2", "n3")}
    plan_ = make_plan(
        pods=[tpod("n2")],
        copies={"ds": [view(["n1"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2", "n3"),
        metric={("ds", "A"): SCALE_OUT},
    )
    [change] = plan_.changes
    assert change.add == {"n2": EVENT, "n3": METRIC}  # not n2 again: it already joins
    assert change.metric == SCALE_OUT


def test_max_nodes_drops_the_metric_addition_first():
    nodes = {n: knode(n) for n in ("n1", "n2", "n3")}
    plan_ = make_plan(
        pods=[tpod("n2")],
        copies={"ds": [view(["n1"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2", "n3"),
        metric={("ds", "A"): SCALE_OUT},
        limits=Limits(max_nodes=2),
    )
    [change] = plan_.changes
    assert (change.add, change.metric) == ({"n2": EVENT}, None)


def test_metric_scale_out_without_a_spare_node_waits():
    plan_ = make_plan(
        copies={"ds": [view(["n1"])]},
        kube_nodes={"n1": knode("n1"), "n2": knode("n2", labeled=False)},
        workers=workers("n1", "n2"),
        metric={("ds", "A"): SCALE_OUT},
    )
    assert plan_.changes == []
    assert any("no labelled node" in w for w in plan_.waiting)


def test_metric_scale_in_removes_its_node_but_respects_min_nodes():
    nodes = {"n1": knode("n1"), "n2": knode("n2", added={("ds", "A"): METRIC})}
    kwargs = dict(
        copies={"ds": [view(["n1", "n2"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2"),
        metric={("ds", "A"): SCALE_IN},
    )
    [change] = make_plan(**kwargs).changes
    assert (change.remove, change.metric) == (["n2"], SCALE_IN)
    at_floor = make_plan(**kwargs, limits=Limits(min_nodes=2))
    assert at_floor.changes == []


def test_event_trigger_leaves_metric_nodes_alone_and_metric_spares_nodes_with_pods():
    nodes = {
        "n1": knode("n1"),
        "n2": knode("n2", added={("ds", "A"): METRIC}),  # no pods: the event trigger keeps it
        "n3": knode("n3", added={("ds", "A"): METRIC}),  # runs a pod: the metric keeps it
    }
    plan_ = make_plan(
        pods=[tpod("n3")],
        copies={"ds": [view(["n1", "n2", "n3"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2", "n3"),
    )
    assert plan_.changes == []
    shrink = make_plan(
        pods=[tpod("n3")],
        copies={"ds": [view(["n1", "n2", "n3"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2", "n3"),
        metric={("ds", "A"): SCALE_IN},
    )
    assert [c.remove for c in shrink.changes] == [["n2"]]


# --- the plan: ownership records and labels ------------------------------------------------------


def test_stale_ownership_records_are_dropped_but_pending_additions_kept():
    nodes = {
        "n1": knode("n1", added={("ds", "A"): EVENT, ("gone", "A"): EVENT, ("ds", "Z"): METRIC}),
        "n2": knode("n2", added={("ds", "A"): EVENT}),  # not in the copy, but joining now
        "n3": knode("n3", added={("ds", "A"): EVENT}),  # not in the copy, no pod: stale
    }
    plan_ = make_plan(
        pods=[tpod("n1"), tpod("n2")],
        copies={"ds": [view(["n1"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2", "n3"),
    )
    assert plan_.retag == {"n1": {("ds", "A"): EVENT}, "n3": {}}


def test_unlabel_only_the_scalers_labels_of_idle_nodes_that_serve_nothing():
    nodes = {
        "idle": knode("idle", by_scaler=True),
        "operator": knode("operator"),  # labelled by an operator: never removed
        "in-copy": knode("in-copy", by_scaler=True),
        "fill-source": knode("fill-source", by_scaler=True),
        "leaving": knode("leaving", by_scaler=True),
        "other-dataset": knode("other-dataset", by_scaler=True),
        "pod": knode("pod", by_scaler=True),
        "pod-unknown-ds": knode("pod-unknown-ds", by_scaler=True),
    }
    copies = {
        "ds": [view(["in-copy"], fill_nodes=["fill-source", "leaving"], filling=True)],
        "ds2": [view(["other-dataset"], dataset="ds2")],
    }
    plan_ = make_plan(
        pods=[tpod("pod", dataset="ds2"), tpod("pod-unknown-ds", dataset="nope")],
        copies=copies,
        kube_nodes=nodes,
        workers=workers(*nodes),
    )
    assert plan_.unlabel == ["idle", "pod-unknown-ds"]


def test_a_node_being_added_is_not_unlabelled():
    nodes = {"n1": knode("n1"), "n2": knode("n2", by_scaler=True)}
    plan_ = make_plan(
        copies={"ds": [view(["n1"])]},
        kube_nodes=nodes,
        workers=workers("n1", "n2"),
        metric={("ds", "A"): SCALE_OUT},
    )
    assert [c.add for c in plan_.changes] == [{"n2": METRIC}]
    assert plan_.unlabel == []


def test_label_comes_off_only_after_the_node_left_the_copy():
    """The order over passes: the node leaves the copy (one pass), its hand-off runs (the node
    is a fill source/leaving node), and only when the copy no longer needs it is it
    unlabelled."""
    nodes = {"n1": knode("n1"), "n2": knode("n2", by_scaler=True, added={("ds", "A"): EVENT})}
    ws = workers("n1", "n2")
    first = make_plan(copies={"ds": [view(["n1", "n2"])]}, kube_nodes=nodes, workers=ws)
    assert [c.remove for c in first.changes] == [["n2"]] and first.unlabel == []
    nodes["n2"] = knode("n2", by_scaler=True)  # its record dropped after the scale
    filling = {"ds": [view(["n1"], fill_nodes=["n1", "n2"], filling=True)]}
    second = make_plan(copies=filling, kube_nodes=nodes, workers=ws)
    assert second.changes == [] and second.unlabel == []
    third = make_plan(copies={"ds": [view(["n1"])]}, kube_nodes=nodes, workers=ws)
    assert third.unlabel == ["n2"]
