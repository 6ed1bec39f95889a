"""The kube-scheduler extender (``coordinator/extender/``).

Three levels: the pure functions (parsing ExtenderArgs, the filter and prioritize decisions,
the answer shapes); :class:`Extender` over a real :class:`Cluster` (LMDB store, fake clock);
and the HTTP routes, on the coordinator app served by hypercorn in this process and on a real
``cachefs coordinator`` process. The request and answer bodies under ``extender_bodies/`` are
in the exact form of kube-scheduler's ``k8s.io/kube-scheduler/extender/v1`` types (see the
README there); the cluster they are answered against is :func:`_imagenet_state`: gpu-node-1
holds 600 of imagenet's 1000 bytes, gpu-node-2 300, gpu-node-3 none.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.api import create_app
from coordinator.extender.decide import (
    DatasetLocality,
    Extender,
    JobStatus,
    decide_filter,
    decide_priorities,
    filter_result,
)
from coordinator.extender.request import (
    ExtenderArgs,
    MalformedArgs,
    parse_extender_args,
    parse_pod,
    pod_gpus,
)
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from coordinator.state import LmdbStateStore
from tests.coordinator_model import FakeClock, spec
from tests.fakes.wrappers import served as serving

BODIES = Path(__file__).parent / "extender_bodies"
NODES = ["gpu-node-1", "gpu-node-2", "gpu-node-3"]
POD_JOB = "ml-team.resnet-train"  # the id derived from the fixture pod's namespace and Job
TOKEN = "extender-test-token"
RESULT_KEYS = ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]


def body(name: str) -> Any:
    return json.loads((BODIES / name).read_text())


def encoded(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def pod_with(request: dict, *, labels: dict | None = None, annotations: dict | None = None) -> dict:
    """``request`` with the pod's labels/annotations updated (a value None removes the key)."""
    changed = copy.deepcopy(request)
    meta = changed["Pod"]["metadata"]
    for key, updates in (("labels", labels), ("annotations", annotations)):
        for name, value in (updates or {}).items():
            if value is None:
                meta[key].pop(name, None)
            else:
                meta[key][name] = value
    return changed


def locality(cached: dict[str, int], *, down=(), copies=None) -> DatasetLocality:
    return DatasetLocality("imagenet", cached, frozenset(down), copies or {"A": frozenset(NODES)})


def job(state: str = "running", copy_id: str | None = "A", position: int | None = None):
    explanation = (
        "running on copy A: 1 of 1 nodes hold the copy"
        if state == "running"
        else "suspended: every copy of imagenet runs 1 jobs (max_jobs_per_copy)"
    )
    return JobStatus(POD_JOB, "imagenet", state, position, copy_id, explanation)


# --- parsing ----------------------------------------------------------------------------------


def test_parse_node_names_request() -> None:
    args = parse_extender_args((BODIES / "filter_node_names_request.json").read_bytes())
    assert args.node_names == tuple(NODES) and args.node_list is None
    assert args.candidates == NODES
    assert args.cachefs_ids == {n: n for n in NODES}
    pod = args.pod
    assert (pod.namespace, pod.name) == ("ml-team", "resnet-train-0-7xq2k")
    assert (pod.dataset, pod.locality, pod.job, pod.notes) == ("imagenet", "required", POD_JOB, ())


def test_parse_nodes_request_keeps_the_node_objects() -> None:
    request = body("filter_nodes_request.json")
    args = parse_extender_args(encoded(request))
    assert args.node_names is None
    assert args.node_list == request["Nodes"]
    assert args.candidates == NODES
    assert args.pod.locality == "required"


def test_keys_match_case_insensitively_as_in_go() -> None:
    request = body("filter_node_names_request.json")
    for pod_key, names_key in [("pod", "nodeNames"), ("POD", "nodenames"), ("Pod", "NODENAMES")]:
        args = parse_extender_args(
            encoded({pod_key: request["Pod"], names_key: NODES, "nodes": None})
        )
        assert args.pod.dataset == "imagenet" and args.node_names == tuple(NODES)
    nodes = body("filter_nodes_request.json")["Nodes"]
    args = parse_extender_args(encoded({"pod": request["Pod"], "nodes": nodes}))
    assert args.candidates == NODES


def test_annotation_wins_over_label_and_locality_values() -> None:
    def pod(labels: dict, annotations: dict) -> dict:
        return {"metadata": {"name": "p", "namespace": "ns", "labels": labels,
                             "annotations": annotations}}  # fmt: skip

    both = parse_pod(pod({"cachefs.io/dataset": "a"}, {"cachefs.io/dataset": "b"}))
    assert both.dataset == "b"
    assert parse_pod(pod({"cachefs.io/dataset": "a"}, {"cachefs.io/dataset": " "})).dataset == "a"
    assert parse_pod(pod({}, {"cachefs.io/dataset": " b "})).dataset == "b"
    for value, expected in [("required", "required"), ("Required", "required"),
                            ("preferred", "preferred"), ("", "preferred")]:  # fmt: skip
        got = parse_pod(pod({"cachefs.io/dataset": "a"}, {"cachefs.io/locality": value}))
        assert (got.locality, got.notes) == (expected, ()), value
    odd = parse_pod(pod({"cachefs.io/dataset": "a", "cachefs.io/locality": "strict"}, {}))
    assert odd.locality == "preferred" and "'strict'" in odd.notes[0]


def test_a_pods_policy_and_gpus() -> None:
    def pod(annotations: dict, *containers: dict) -> dict:
        return {"metadata": {"name": "p", "namespace": "ns", "annotations": annotations,
                             "labels": {"cachefs.io/dataset": "a"}},
                "spec": {"containers": list(containers)}}  # fmt: skip

    fixture = parse_extender_args((BODIES / "prioritize_node_names_request.json").read_bytes())
    assert (fixture.pod.policy, fixture.pod.gpus) == (None, 8)  # limits "8"
    two = {"resources": {"limits": {"nvidia.com/gpu": "2"}}}
    one = {"resources": {"requests": {"nvidia.com/gpu": 1, "cpu": "4"}}}
    named = parse_pod(pod({"cachefs.io/policy": "p2-elastic+locality"}, two, one, {}))
    assert (named.policy, named.gpus, named.notes) == ("p2-elastic+locality", 3, ())
    unknown = parse_pod(pod({"cachefs.io/policy": "lottery"}))
    assert (unknown.policy, unknown.gpus) == (None, 1)
    (note,) = unknown.notes
    assert note == "cachefs.io/policy='lottery' is no known policy; scoring by cached bytes"
    fractional = {"resources": {"limits": {"nvidia.com/gpu": "1.5"}}}
    for odd in (None, [], {"containers": "x"}, {"containers": [fractional]}):
        assert pod_gpus(odd) == 1


def test_job_id_of_a_pod() -> None:
    def job_of(meta: dict) -> str | None:
        meta = {"name": "p-0-abcde", "labels": {}, **meta}
        meta["labels"] = {"cachefs.io/dataset": "imagenet", **meta["labels"]}
        return parse_pod({"metadata": meta}).job

    owner = [{"kind": "PyTorchJob", "name": "bert", "controller": True},
             {"kind": "Other", "name": "x", "controller": False}]  # fmt: skip
    assert job_of({"namespace": "a", "annotations": {"cachefs.io/job": "explicit"}}) == "explicit"
    assert job_of({"namespace": "a", "labels": {"cachefs.io/job": "lbl"}}) == "lbl"
    assert job_of({"namespace": "a", "labels": {"batch.kubernetes.io/job-name": "j"}}) == "a.j"
    assert job_of({"namespace": "a", "labels": {"job-name": "old"}}) == "a.old"
    assert job_of({"namespace": "a", "ownerReferences": owner}) == "a.bert"
    assert job_of({"namespace": "a", "ownerReferences": owner[1:]}) == "a.p-0-abcde"
    assert job_of({}) == "default.p-0-abcde"
    # No dataset: nothing to look up unless the pod names its job.
    assert parse_pod({"metadata": {"name": "web", "labels": {"job-name": "j"}}}).job is None
    named = parse_pod({"metadata": {"name": "w", "annotations": {"cachefs.io/job": "j7"}}})
    assert (named.dataset, named.job) == (None, "j7")
    assert parse_pod({}) == parse_pod({"metadata": None})


def test_node_label_maps_to_a_cachefs_node_id() -> None:
    request = body("filter_nodes_request.json")
    request["Nodes"]["items"][2]["metadata"]["labels"]["cachefs.io/node"] = "n3"
    args = parse_extender_args(encoded(request))
    assert args.cachefs_ids == {"gpu-node-1": "gpu-node-1", "gpu-node-2": "gpu-node-2",
                                "gpu-node-3": "n3"}  # fmt: skip
    # n3 holds the data: gpu-node-3 passes the required filter and scores.
    held = locality({"gpu-node-1": 600, "n3": 300}, copies={"A": frozenset(["n3"])})
    assert decide_filter(args, held, None).passed == ("gpu-node-1", "gpu-node-3")
    assert decide_priorities(args, held, None) == [
        ("gpu-node-1", 10), ("gpu-node-2", 0), ("gpu-node-3", 5)
    ]  # fmt: skip


MALFORMED = [
    b"",
    b"not json",
    b"\xff\xfe\x00garbage",
    b"[]",
    b"null",
    b'"ExtenderArgs"',
    b'{"Pod": {}}',
    b'{"Pod": 3, "NodeNames": ["a"]}',
    b'{"Pod": {}, "NodeNames": "a"}',
    b'{"Pod": {}, "NodeNames": ["a", 1]}',
    b'{"Pod": {}, "NodeNames": [""]}',
    b'{"Pod": {}, "Nodes": []}',
    b'{"Pod": {}, "Nodes": {"items": {}}}',
    b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}',
    b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": 5}}]}}',
    b'{"Pod": {}, "NodeNames": ["a"], "x": NaN}',
    b"[" * 100_000 + b"]" * 100_000,
]


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies(raw: bytes) -> None:
    with pytest.raises(MalformedArgs):
        parse_extender_args(raw)


def test_empty_node_lists_are_no_error() -> None:
    # Go marshals an empty NodeList's items as null.
    args = parse_extender_args(b'{"Pod": null, "Nodes": {"metadata": {}, "items": null}}')
    assert args.candidates == [] and args.pod.dataset is None
    assert parse_extender_args(b'{"Pod": {}, "NodeNames": []}').candidates == []


# --- decisions --------------------------------------------------------------------------------


def names_args(request: str = "filter_node_names_request.json", **changes) -> ExtenderArgs:
    return parse_extender_args(encoded(pod_with(body(request), **changes)))


def test_required_filters_nodes_that_hold_none() -> None:
    args = names_args()
    decision = decide_filter(args, locality({"gpu-node-1": 600, "gpu-node-2": 300}), None)
    assert decision.passed == ("gpu-node-1", "gpu-node-2")
    assert list(decision.failed) == ["gpu-node-3"]
    assert "holds none of dataset imagenet" in decision.failed["gpu-node-3"]
    # A down worker's bytes are not readable: it fails too, saying why.
    decision = decide_filter(args, locality({"gpu-node-1": 600}, down={"gpu-node-2"}), None)
    assert decision.passed == ("gpu-node-1",)
    assert "worker is down" in decision.failed["gpu-node-2"]
    assert "holds none" in decision.failed["gpu-node-3"]


def test_required_with_no_node_holding_any_fails_them_all() -> None:
    decision = decide_filter(names_args(), locality({}), None)
    assert decision.passed == () and list(decision.failed) == NODES
    # One text for every node, so that the pod's event aggregates them ("3 cachefs: ...").
    assert len(set(decision.failed.values())) == 1


def test_preferred_and_unknown_filter_nothing() -> None:
    preferred = names_args(annotations={"cachefs.io/locality": None})
    assert decide_filter(preferred, locality({}), None).passed == tuple(NODES)
    assert decide_filter(names_args(), None, None).passed == tuple(NODES)  # unknown dataset
    assert decide_filter(preferred, locality({}), job("running")).failed == {}


def test_a_suspended_job_fails_every_node_with_its_queue_position() -> None:
    decision = decide_filter(names_args(), locality({"gpu-node-1": 600}), job("suspended", None, 2))
    assert decision.passed == ()
    assert set(decision.failed.values()) == {
        f"cachefs: job {POD_JOB} is suspended, position 2 in the queue of dataset imagenet "
        "(every copy of imagenet runs 1 jobs (max_jobs_per_copy)); it runs once the "
        "CacheManager promotes it"
    }
    assert list(decision.failed) == NODES
    # Whether the dataset is known or not.
    assert decide_filter(names_args(), None, job("suspended", None, 1)).passed == ()


def test_scores_follow_cached_bytes_relative_to_the_best_node() -> None:
    args = names_args("prioritize_node_names_request.json")
    scores = decide_priorities(args, locality({"gpu-node-1": 600, "gpu-node-2": 300}), None)
    assert scores == [("gpu-node-1", 10), ("gpu-node-2", 5), ("gpu-node-3", 0)]
    # Any cached byte scores at least 1; the order is the request's.
    scores = decide_priorities(args, locality({"gpu-node-2": 10**12, "gpu-node-3": 1}), None)
    assert scores == [("gpu-node-1", 0), ("gpu-node-2", 10), ("gpu-node-3", 1)]
    assert [s for _, s in decide_priorities(args, locality({}), None)] == [0, 0, 0]
    assert [s for _, s in decide_priorities(args, None, None)] == [0, 0, 0]
    assert [s for _, s in decide_priorities(args, locality({"gpu-node-1": 5}), job(
        "suspended", None, 1))] == [0, 0, 0]  # fmt: skip


def test_a_running_jobs_copy_outranks_other_nodes() -> None:
    args = names_args("prioritize_node_names_request.json")
    held = {"gpu-node-1": 600, "gpu-node-2": 300}
    # The job runs on clone B (gpu-node-3, nothing cached yet): TDCS puts its copy first.
    clone = locality(held, copies={"A": frozenset(NODES[:2]), "B": frozenset(["gpu-node-3"])})
    assert decide_priorities(args, clone, job("running", "B")) == [
        ("gpu-node-1", 4), ("gpu-node-2", 2), ("gpu-node-3", 5)
    ]  # fmt: skip
    # On copy A (every node): the band is 5..10, by cached bytes.
    assert decide_priorities(args, locality(held), job("running", "A")) == [
        ("gpu-node-1", 10), ("gpu-node-2", 8), ("gpu-node-3", 5)
    ]  # fmt: skip
    # A copy that no longer exists: plain cached-bytes scores.
    assert decide_priorities(args, locality(held), job("running", "Z")) == [
        ("gpu-node-1", 10), ("gpu-node-2", 5), ("gpu-node-3", 0)
    ]  # fmt: skip


def test_filter_result_answers_in_the_form_of_the_request() -> None:
    request = body("filter_nodes_request.json")
    both = {**request, "NodeNames": list(reversed(NODES))}
    args = parse_extender_args(encoded(both))
    result = filter_result(args, decide_filter(args, locality({"gpu-node-2": 1}), None))
    assert list(result) == RESULT_KEYS
    assert result["NodeNames"] == ["gpu-node-2"]
    assert result["Nodes"] == {"metadata": {}, "items": [request["Nodes"]["items"][1]]}
    assert set(result["FailedNodes"]) == {"gpu-node-1", "gpu-node-3"}
    assert result["FailedAndUnresolvableNodes"] == result["FailedNodes"]
    assert result["Error"] == ""


# --- Extender over a Cluster ------------------------------------------------------------------


def _imagenet_report(cached: int) -> dict:
    return {"bytes": 1000, "files": 10, "cached_bytes": cached, "shards": {}}


def _imagenet_state(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1))
    for i, node in enumerate(NODES, 1):
        cached = {"gpu-node-1": 600, "gpu-node-2": 300}.get(node)
        datasets = {"imagenet": _imagenet_report(cached)} if cached else {}
        coordinator.heartbeat(node, {"address": f"127.0.0.{i + 1}:7070", "datasets": datasets})


def test_extender_answers_the_fixtures_from_the_cluster(coordinator: Coordinator) -> None:
    _imagenet_state(coordinator)
    extender = Extender(coordinator)
    for request, answer in [
        ("filter_node_names_request.json", "filter_node_names_response.json"),
        ("filter_nodes_request.json", "filter_nodes_response.json"),
    ]:
        assert extender.filter((BODIES / request).read_bytes()) == body(answer)
    prioritize = (BODIES / "prioritize_node_names_request.json").read_bytes()
    assert extender.prioritize(prioritize) == body("prioritize_node_names_response.json")


def test_suspended_then_promoted(coordinator: Coordinator) -> None:
    _imagenet_state(coordinator)
    extender = Extender(coordinator)
    request = (BODIES / "filter_node_names_request.json").read_bytes()
    coordinator.manager.jobs.submit("other", "imagenet", 1)
    suspended = coordinator.manager.jobs.submit(POD_JOB, "imagenet", 1)
    assert (suspended["state"], suspended["position"]) == ("suspended", 1)
    assert extender.filter(request) == body("filter_suspended_response.json")
    scores = extender.prioritize((BODIES / "prioritize_node_names_request.json").read_bytes())
    assert scores == [{"Host": n, "Score": 0} for n in NODES]
    # The running job is released: the pod's job is promoted and its next attempt passes.
    assert coordinator.manager.jobs.release("other")["promoted"] == [POD_JOB]
    assert extender.filter(request) == body("filter_node_names_response.json")


def test_a_down_worker_fails_required(coordinator: Coordinator, clock: FakeClock) -> None:
    _imagenet_state(coordinator)
    clock.advance(10)  # past down_after: every worker is down until it beats again
    coordinator.heartbeat("gpu-node-1", {"address": "127.0.0.2:7070",
                                     "datasets": {"imagenet": _imagenet_report(600)}})  # fmt: skip
    answer = Extender(coordinator).filter((BODIES / "filter_node_names_request.json").read_bytes())
    assert answer["NodeNames"] == ["gpu-node-1"]
    assert "worker is down" in answer["FailedNodes"]["gpu-node-2"]
    assert "holds none" in answer["FailedNodes"]["gpu-node-3"]


def test_unknown_datasets_and_unlabelled_pods_pass_logged_once(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    _imagenet_state(coordinator)
    extender = Extender(coordinator)
    unknown = encoded(pod_with(body("filter_node_names_request.json"),
                               labels={"cachefs.io/dataset": "no-such"}))  # fmt: skip
    unlabelled = encoded(pod_with(body("filter_node_names_request.json"),
                                  labels={"cachefs.io/dataset": None}))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="coordinator.extender"):
        for _ in range(3):
            for request in (unknown, unlabelled):
                answer = extender.filter(request)
                assert answer == {"Nodes": None, "NodeNames": NODES, "FailedNodes": {},
                                  "FailedAndUnresolvableNodes": {}, "Error": ""}  # fmt: skip
                assert extender.prioritize(request) == [{"Host": n, "Score": 0} for n in NODES]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'no-such'" in warnings[0], warnings


def test_a_pods_policy_ranks_the_nodes(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    _imagenet_state(coordinator)
    for i, node in enumerate(NODES, 1):  # the same heartbeats, with GPUs: 8, 8 and none
        cached = {"gpu-node-1": 600, "gpu-node-2": 300}.get(node)
        datasets = {"imagenet": _imagenet_report(cached)} if cached else {}
        report = {"address": f"127.0.0.{i + 1}:7070", "gpus": 8 if i < 3 else 0}
        coordinator.heartbeat(node, {**report, "datasets": datasets})
    extender = Extender(coordinator)
    request = body("prioritize_node_names_request.json")

    def scores(policy: str | None) -> list[int]:
        annotated = pod_with(request, annotations={"cachefs.io/policy": policy})
        return [row["Score"] for row in extender.prioritize(encoded(annotated))]

    assert scores(None) == [10, 5, 0]  # cached bytes relative to the best node
    # fifo+locality ranks the nodes that can take GPUs by cached bytes, one step per rank;
    # gpu-node-3 has no GPUs, so no policy ranks it.
    assert scores("fifo+locality") == [10, 5, 0]
    assert scores("tdcs") == [10, 5, 0]
    # Best fit without locality: both nodes have all 8 GPUs free, so they tie.
    assert scores("p2-elastic") == [10, 10, 0]
    coordinator.heartbeat("gpu-node-3", {"address": "127.0.0.4:7070", "gpus": 8, "datasets": {}})
    assert scores("fifo+locality") == [10, 7, 4]
    # A policy that cannot rank (no node hardware) falls back to cached bytes, logged once.
    with caplog.at_level(logging.WARNING, logger="coordinator.extender"):
        assert scores("p4-roofline") == scores("p4-roofline") == [10, 5, 0]
    assert len(caplog.records) == 1, caplog.records
    assert "prioritize with p4-roofline: policy p4-roofline needs" in caplog.records[0].getMessage()
    # A job the CacheManager suspended scores 0 everywhere, policy or not.
    coordinator.manager.jobs.submit("other", "imagenet", 1)
    coordinator.manager.jobs.submit(POD_JOB, "imagenet", 1)
    assert scores("fifo+locality") == [0, 0, 0]


def test_a_job_annotation_alone_names_the_dataset(coordinator: Coordinator) -> None:
    _imagenet_state(coordinator)
    coordinator.manager.jobs.submit("other", "imagenet", 1)
    coordinator.manager.jobs.submit("queued-job", "imagenet", 1)
    request = pod_with(body("filter_node_names_request.json"),
                       labels={"cachefs.io/dataset": None},
                       annotations={"cachefs.io/job": "queued-job"})  # fmt: skip
    answer = Extender(coordinator).filter(encoded(request))
    assert answer["NodeNames"] == [] and set(answer["FailedNodes"]) == set(NODES)
    assert "job queued-job is suspended" in answer["FailedNodes"]["gpu-node-1"]


def test_a_job_on_another_dataset_decides_and_is_logged_once(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    _imagenet_state(coordinator)
    coordinator.add_dataset(spec("coco", max_jobs_per_copy=1))
    coordinator.manager.jobs.submit("coco-1", "coco", 1)
    coordinator.manager.jobs.submit("coco-2", "coco", 1)
    request = encoded(pod_with(body("filter_node_names_request.json"),
                               annotations={"cachefs.io/job": "coco-2"}))  # fmt: skip
    extender = Extender(coordinator)
    with caplog.at_level(logging.WARNING, logger="coordinator.extender"):
        for _ in range(2):
            answer = extender.filter(request)
            assert answer["NodeNames"] == []
            assert "job coco-2 is suspended" in answer["FailedNodes"]["gpu-node-1"]
    assert len(caplog.records) == 1
    assert "'imagenet' but its job 'coco-2' reads coco" in caplog.records[0].getMessage()


def test_internal_errors_pass_every_node(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _imagenet_state(coordinator)

    def broken(dataset: str) -> dict:
        raise RuntimeError("state store on fire")

    monkeypatch.setattr(coordinator.cluster, "locality", broken)
    extender = Extender(coordinator)
    request = (BODIES / "filter_nodes_request.json").read_bytes()
    with caplog.at_level(logging.WARNING, logger="coordinator.extender"):
        for _ in range(2):
            answer = extender.filter(request)
            assert answer["Nodes"] == body("filter_nodes_request.json")["Nodes"]
            assert answer["FailedNodes"] == {} and answer["Error"] == ""
            assert extender.prioritize(request) == [{"Host": n, "Score": 0} for n in NODES]
    errors = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage().split()[0] for r in errors] == ["filter", "prioritize"]


def test_malformed_bodies_get_an_error_or_no_scores(coordinator: Coordinator) -> None:
    extender = Extender(coordinator)
    for raw in MALFORMED:
        answer = extender.filter(raw)
        assert list(answer) == RESULT_KEYS
        assert answer["Error"].startswith("cachefs extender: ")
        assert (answer["Nodes"], answer["NodeNames"]) == (None, None)
        assert extender.prioritize(raw) == []


def test_the_extender_changes_nothing(coordinator: Coordinator, store: LmdbStateStore) -> None:
    _imagenet_state(coordinator)
    coordinator.manager.jobs.submit("other", "imagenet", 1)
    before = list(store.list(""))
    jobs_before = {k: v.to_json() for k, v in coordinator.manager.jobs.by_id.items()}
    extender = Extender(coordinator)
    for name in ("filter_node_names_request.json", "filter_nodes_request.json",
                 "prioritize_node_names_request.json"):  # fmt: skip
        extender.filter((BODIES / name).read_bytes())
        extender.prioritize((BODIES / name).read_bytes())
    assert list(store.list("")) == before
    assert {k: v.to_json() for k, v in coordinator.manager.jobs.by_id.items()} == jobs_before
    assert POD_JOB not in coordinator.manager.jobs.by_id  # filter registers no job


# --- HTTP -------------------------------------------------------------------------------------


@dataclass
class Served:
    client: httpx.AsyncClient  # sends no token, as kube-scheduler does
    admin: httpx.AsyncClient  # sends the token
    coordinator: Coordinator


@pytest.fixture
async def served(tmp_path) -> AsyncIterator[Served]:
    store = LmdbStateStore(tmp_path / "state")
    try:
        # Workers beat once per test: they must stay up however slow the machine is.
        coordinator = Coordinator(
            store, CoordinatorSettings(heartbeat_interval_s=1.0, down_after_s=3600)
        )
        async with serving(create_app(coordinator, TOKEN)) as address:
            url = f"http://{address}"
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as admin,
            ):
                yield Served(client, admin, coordinator)
    finally:
        store.close()


async def _imagenet_over_http(admin: httpx.AsyncClient) -> None:
    dataset = {"name": "imagenet", "uri": "s3://bucket/imagenet/", "max_jobs_per_copy": 1}
    assert (await admin.post("/v1/datasets", json=dataset)).status_code == 201
    for i, node in enumerate(NODES, 1):
        cached = {"gpu-node-1": 600, "gpu-node-2": 300}.get(node)
        report = {"address": f"127.0.0.{i + 1}:7070"}
        if cached:
            report["datasets"] = {"imagenet": _imagenet_report(cached)}
        beat = await admin.post(f"/v1/nodes/{node}/heartbeat", json=report)
        assert beat.status_code == 200, beat.text


async def _post(client: httpx.AsyncClient, verb: str, content: bytes) -> Any:
    response = await client.post(
        f"/scheduler/{verb}", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


async def test_http_answers_the_fixtures_without_a_token(served: Served) -> None:
    await _imagenet_over_http(served.admin)
    for request, answer in [
        ("filter_node_names_request.json", "filter_node_names_response.json"),
        ("filter_nodes_request.json", "filter_nodes_response.json"),
    ]:
        got = await _post(served.client, "filter", (BODIES / request).read_bytes())
        assert got == body(answer)
        assert list(got) == RESULT_KEYS  # Go's field names, in its order
    got = await _post(
        served.client, "prioritize", (BODIES / "prioritize_node_names_request.json").read_bytes()
    )
    assert got == body("prioritize_node_names_response.json")
    # A wrong token changes nothing either: the routes do not look at it.
    wrong = {"Authorization": "Bearer wrong", "Content-Type": "application/json"}
    response = await served.client.post(
        "/scheduler/filter",
        content=(BODIES / "filter_node_names_request.json").read_bytes(),
        headers=wrong,
    )
    assert response.json() == body("filter_node_names_response.json")
    health = await served.client.get("/scheduler/healthz")
    assert health.json() == {"ok": True, "cluster_id": served.coordinator.cluster_id}


async def test_http_suspended_job_keeps_the_pod_pending(served: Served) -> None:
    admin = served.admin
    await _imagenet_over_http(admin)
    first = await admin.post("/v1/jobs", json={"id": "other", "dataset": "imagenet"})
    assert first.json()["state"] == "running"
    queued = await admin.post("/v1/jobs", json={"id": POD_JOB, "dataset": "imagenet"})
    assert queued.json()["state"] == "suspended"
    request = (BODIES / "filter_node_names_request.json").read_bytes()
    assert await _post(served.client, "filter", request) == body("filter_suspended_response.json")
    assert (await admin.delete("/v1/jobs/other")).json()["promoted"] == [POD_JOB]
    assert await _post(served.client, "filter", request) == body("filter_node_names_response.json")


async def test_http_pass_through_and_malformed(served: Served) -> None:
    await _imagenet_over_http(served.admin)
    unknown = pod_with(body("filter_nodes_request.json"), labels={"cachefs.io/dataset": "nope"})
    got = await _post(served.client, "filter", encoded(unknown))
    assert got["Nodes"] == unknown["Nodes"] and got["FailedNodes"] == {}
    scores = await _post(served.client, "prioritize", encoded(unknown))
    assert scores == [{"Host": n, "Score": 0} for n in NODES]
    for raw in (b"", b"{not json", b'{"Pod": {}}', b"[" * 100_000):
        got = await _post(served.client, "filter", raw)
        assert got["Error"].startswith("cachefs extender: ") and got["NodeNames"] is None
        assert await _post(served.client, "prioritize", raw) == []
    # A lone surrogate in a node name is echoed as an escape, not a 500.
    odd = await _post(served.client, "filter", b'{"Pod": null, "NodeNames": ["n\\ud800"]}')
    assert odd["NodeNames"] == ["n\ud800"]


async def test_http_routes_are_in_the_spec(served: Served) -> None:
    spec_doc = (await served.client.get("/openapi.json")).json()
    for path in ("/scheduler/filter", "/scheduler/prioritize"):
        operation = spec_doc["paths"][path]["post"]
        body = operation["requestBody"]
        # Any body, or none, is answered 200 (with Error set): the spec allows any.
        assert body["required"] is False
        args = body["content"]["application/json"]["schema"]["anyOf"][0]
        assert set(args["properties"]) == {"Pod", "Nodes", "NodeNames"}
        assert list(operation["responses"]) == ["200"]
    assert "/scheduler/healthz" in spec_doc["paths"]


def test_on_a_coordinator_process(tmp_path) -> None:
    """The routes as the DaemonSet's coordinator serves them: `cachefs coordinator`."""
    from tests.cluster_process import TOKEN as PROCESS_TOKEN
    from tests.cluster_process import CoordinatorProcess

    # The test's nodes beat once: they must stay up however slow the machine is.
    coordinator = CoordinatorProcess(str(tmp_path), extra_args=("--down-after", "1h")).start()
    try:
        auth = {"Authorization": f"Bearer {PROCESS_TOKEN}"}
        with httpx.Client(base_url=coordinator.url, headers=auth, timeout=30) as admin:
            dataset = {"name": "imagenet", "uri": "s3://bucket/imagenet/"}
            assert admin.post("/v1/datasets", json=dataset).status_code == 201
            for i, node in enumerate(NODES, 1):
                cached = {"gpu-node-1": 600, "gpu-node-2": 300}.get(node)
                report: dict[str, Any] = {"address": f"127.0.0.{i + 1}:7070"}
                if cached:
                    report["datasets"] = {"imagenet": _imagenet_report(cached)}
                assert admin.post(f"/v1/nodes/{node}/heartbeat", json=report).status_code == 200
        with httpx.Client(base_url=coordinator.url, timeout=30) as scheduler:
            for verb, request, answer in [
                ("filter", "filter_nodes_request.json", "filter_nodes_response.json"),
                ("prioritize", "prioritize_node_names_request.json",
                 "prioritize_node_names_response.json"),
            ]:  # fmt: skip
                response = scheduler.post(
                    f"/scheduler/{verb}",
                    content=(BODIES / request).read_bytes(),
                    headers={"Content-Type": "application/json"},
                )
                assert response.status_code == 200, response.text
                assert response.json() == body(answer)
    finally:
        coordinator.cleanup()
    assert "Traceback" not in coordinator.log()
