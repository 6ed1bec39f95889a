"""``POST /v1/schedule`` against a real coordinator process (`cachefs coordinator` on a free
127.0.0.1 port, its LMDB state in a temporary directory): each policy family decides a small,
hand-checked queue; locality read from the workers' heartbeats moves the chosen nodes; bad input
is a 4xx with a one-line message; the route and its examples are in the published spec."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.cluster_process import TOKEN, CoordinatorProcess

AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = ("n1", "n2", "n3")
GB = 10**9


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[CoordinatorProcess]:
    # Nodes stay up for the whole module without a heartbeat thread.
    process = CoordinatorProcess(
        str(tmp_path_factory.mktemp("schedule")), extra_args=("--down-after", "1h")
    ).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def api(coordinator: CoordinatorProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=coordinator.url, headers=AUTH, timeout=60) as client:
        for name in ("imagenet", "coco"):
            body = {"name": name, "uri": f"s3://bucket/{name}/"}
            assert client.post("/v1/datasets", json=body).status_code == 201
        for node in NODES:
            beat(client, node, {})
        yield client


def beat(client: httpx.Client, node: str, cached: dict[str, int]) -> None:
    """A worker's heartbeat: ``cached`` is dataset -> bytes cached on the node (of 100 GB)."""
    report = {
        "address": f"127.0.0.{NODES.index(node) + 2}:7070",
        "gpus": 8,
        "tiers": [{"name": "ram", "capacity": 200 * GB, "used": sum(cached.values())}],
        "datasets": {
            name: {"bytes": 100 * GB, "cached_bytes": nbytes} for name, nbytes in cached.items()
        },
    }
    response = client.post(f"/v1/nodes/{node}/heartbeat", json=report)
    assert response.status_code == 200, response.text


def schedule(api: httpx.Client, policy: str, nodes: dict[str, int], jobs: list, **extra) -> dict:
    body = {
        "policy": policy,
        "nodes": [{"name": name, "free_gpus": free} for name, free in nodes.items()],
        "jobs": jobs,
        **extra,
    }
    response = api.post("/v1/schedule", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["policy"] == policy
    assert [d["job"] for d in answer["decisions"]] == [job["id"] for job in jobs]
    return answer


def decided(answer: dict) -> dict[str, tuple[str, dict[str, int]]]:
    """job -> (action, {node: gpus})"""
    return {
        d["job"]: (d["action"], {p["node"]: p["gpus"] for p in d["placement"]})
        for d in answer["decisions"]
    }


def test_fifo_starts_in_order_until_the_gpus_run_out(api: httpx.Client) -> None:
    jobs = [
        {"id": "a", "gpus": 4, "arrival": 1},
        {"id": "b", "gpus": 8, "arrival": 2},
        {"id": "c", "gpus": 8, "arrival": 3},
        {"id": "d", "gpus": 1, "arrival": 4},
    ]
    answer = schedule(api, "fifo", {"n1": 8, "n2": 8}, jobs)
    assert decided(answer) == {
        "a": ("start", {"n1": 4}),
        "b": ("start", {"n2": 8}),
        "c": ("wait", {}),
        "d": ("wait", {}),  # 4 GPUs are free, but FIFO does not let it pass c
    }
    reasons = {d["job"]: d["reason"] for d in answer["decisions"]}
    assert reasons["c"] == "not enough free GPUs"
    assert reasons["d"] == "behind an earlier job in FIFO order"
    assert answer["now"] == 4  # the latest arrival when no now is given
    # Arrival, not the list, orders the queue: d first now.
    jobs[3]["arrival"] = 0
    assert decided(schedule(api, "fifo", {"n1": 8, "n2": 8}, jobs))["d"] == ("start", {"n1": 1})


def test_qos_starts_an_urgent_job_before_an_earlier_normal_one(api: httpx.Client) -> None:
    jobs = [
        {"id": "normal", "gpus": 4, "arrival": 0, "qos": "normal"},
        {"id": "urgent", "gpus": 4, "arrival": 10, "qos": "urgent"},
    ]
    qos = decided(schedule(api, "p3-qos", {"n1": 4}, jobs))
    assert qos == {"urgent": ("start", {"n1": 4}), "normal": ("wait", {})}
    # FIFO, for contrast, serves the earlier one.
    fifo = decided(schedule(api, "fifo", {"n1": 4}, jobs))
    assert fifo == {"normal": ("start", {"n1": 4}), "urgent": ("wait", {})}


def test_elastic_grows_into_idle_gpus_and_shrinks_for_a_new_job(api: httpx.Client) -> None:
    running = {
        "id": "big",
        "gpus": 4,
        "max_gpus": 8,
        "epochs": 10,
        "epochs_done": 1,
        "placement": [{"node": "n1", "gpus": 4}],
    }
    # 4 GPUs idle, nobody waiting: P2's expansion gives them to the running job.
    grown = schedule(api, "p2-elastic", {"n1": 4}, [running])
    assert decided(grown) == {"big": ("resize", {"n1": 8})}
    assert grown["decisions"][0]["gpus"] == 8
    # Every GPU held and a request arrives: the reduction frees one GPU for it.
    full = {**running, "placement": [{"node": "n1", "gpus": 8}]}
    new = {"id": "new", "gpus": 2, "arrival": 5}
    shrunk = schedule(api, "p2-elastic", {"n1": 0}, [full, new])
    assert decided(shrunk) == {"big": ("resize", {"n1": 7}), "new": ("start", {"n1": 1})}
    # A gang policy leaves both as they are.
    fifo = decided(schedule(api, "fifo", {"n1": 0}, [full, new]))
    assert fifo == {"big": ("keep", {"n1": 8}), "new": ("wait", {})}


def test_las_preempts_the_job_that_has_run_longest(api: httpx.Client) -> None:
    jobs = [
        {
            "id": "old",
            "gpus": 4,
            "placement": [{"node": "n1", "gpus": 4}],
            "attained_gpu_s": 40_000.0,  # past both thresholds (3600, 36000 GPU-s)
        },
        {
            "id": "young",
            "gpus": 4,
            "placement": [{"node": "n2", "gpus": 4}],
            "attained_gpu_s": 100.0,
        },
        {"id": "new", "gpus": 4, "arrival": 50},
    ]
    answer = schedule(api, "tiresias-las", {"n1": 0, "n2": 0}, jobs)
    assert decided(answer) == {
        "old": ("preempt", {}),
        "young": ("keep", {"n2": 4}),
        "new": ("start", {"n1": 4}),  # on the GPUs the preempted job gives back
    }


def test_themis_grants_the_free_gpus_and_answers_alike_for_alike(api: httpx.Client) -> None:
    jobs = [
        {"id": "x", "gpus": 4, "arrival": 0, "epochs": 5},
        {"id": "y", "gpus": 4, "arrival": 0, "epochs": 50},
        {"id": "z", "gpus": 8, "arrival": 0, "epochs": 20},
    ]
    answer = schedule(api, "p5-themis", {"n1": 8, "n2": 4}, jobs, now=100)
    granted = {job: placement for job, (action, placement) in decided(answer).items()}
    per_node = {"n1": 0, "n2": 0}
    for placement in granted.values():
        for node, gpus in placement.items():
            per_node[node] += gpus
    assert per_node == {"n1": 8, "n2": 4}  # work conserving, nothing over-committed
    # 16 GPUs asked of 12: the longest job, whose finish-time fairness a lease of waiting
    # hurts least, waits; the others get what they asked for.
    assert decided(answer) == {
        "x": ("start", {"n2": 4}),
        "y": ("wait", {}),
        "z": ("start", {"n1": 8}),
    }
    assert schedule(api, "p5-themis", {"n1": 8, "n2": 4}, jobs, now=100) == answer


def test_locality_moves_the_chosen_nodes(api: httpx.Client) -> None:
    free = dict.fromkeys(NODES, 8)
    job = {"id": "train", "gpus": 4, "dataset": "coco"}
    beat(api, "n2", {"coco": 100 * GB})
    answer = schedule(api, "fifo+locality", free, [job])
    assert decided(answer) == {"train": ("start", {"n2": 4})}
    assert answer["locality"] == [
        {
            "dataset": "coco",
            "known": True,
            "size": 100 * GB,
            "cached_bytes": {"n2": 100 * GB},
            "cached_fraction": 1.0,
        }
    ]
    # TDCS reads the same locality (and the CacheManager's copy of the dataset).
    assert decided(schedule(api, "tdcs", free, [job])) == {"train": ("start", {"n2": 4})}
    # The cache moves: so does the job.
    beat(api, "n2", {})
    beat(api, "n3", {"coco": 60 * GB})
    moved = schedule(api, "fifo+locality", free, [job])
    assert decided(moved) == {"train": ("start", {"n3": 4})}
    assert moved["locality"][0]["cached_bytes"] == {"n3": 60 * GB}
    # Without "+locality", or without a dataset, nodes are taken in name order.
    assert decided(schedule(api, "fifo", free, [job])) == {"train": ("start", {"n1": 4})}
    bare = {"id": "train", "gpus": 4}
    assert decided(schedule(api, "fifo+locality", free, [bare])) == {"train": ("start", {"n1": 4})}
    # A dataset the coordinator does not know is scheduled without locality, and said so.
    unknown = schedule(api, "fifo+locality", free, [{**job, "dataset": "mnist"}])
    assert decided(unknown) == {"train": ("start", {"n1": 4})}
    assert unknown["locality"][0]["known"] is False
    beat(api, "n3", {})


def test_bad_input_is_4xx_with_a_one_line_message(api: httpx.Client) -> None:
    nodes = [{"name": "n1", "free_gpus": 8, "gpus": 8}, {"name": "n2", "free_gpus": 8}]
    job = {"id": "j", "gpus": 2}

    def post(**changes) -> httpx.Response:
        body = {"policy": "fifo", "nodes": nodes, "jobs": [job], **changes}
        return api.post("/v1/schedule", json=body)

    # What the spec forbids: 422 naming the field.
    for changes, field in [
        ({"policy": "lottery"}, "policy"),
        ({"jobs": [{**job, "gpus": 0}]}, "gpus"),
        ({"jobs": [{**job, "gpus": True}]}, "gpus"),
        ({"nodes": [{"name": "n1", "free_gpus": 17}]}, "free_gpus"),
        ({"nodes": []}, "nodes"),
        ({"jobs": [{**job, "colour": "blue"}]}, "colour"),
        ({"jobs": [{**job, "qos": "vip"}]}, "qos"),
    ]:
        response = post(**changes)
        assert response.status_code == 422, (changes, response.text)
        assert response.json()["detail"][0]["loc"][-1] == field, response.text
    unknown = post(policy="lottery").json()["detail"][0]["msg"]
    assert "unknown policy 'lottery'" in unknown and "p2-elastic" in unknown
    # Well formed but impossible or inconsistent: 409 with one line saying what.
    running = {**job, "placement": [{"node": "n1", "gpus": 2}]}
    for changes, words in [
        ({"jobs": [{**job, "gpus": 17}]}, "asks for 17 GPUs; the cluster has 16"),
        (
            {"jobs": [{**job, "gpus": 9, "candidates": ["n1", "n7"]}]},
            "asks for 9 GPUs; its candidate nodes have 8",
        ),
        ({"jobs": [job, job]}, "job 'j' is listed twice"),
        ({"nodes": [*nodes, nodes[0]]}, "node 'n1' is listed twice"),
        (
            {"jobs": [{**job, "placement": [{"node": "n9", "gpus": 1}]}]},
            "holds GPUs on 'n9', not in nodes",
        ),
        ({"jobs": [running]}, "'n1': 8 free + 2 held by running jobs > its 8 GPUs"),
        ({"jobs": [{**job, "arrival": 50}], "now": 10}, "arrives at 50, after now (10)"),
        ({"jobs": [{**job, "max_gpus": 1}]}, "max_gpus 1 < gpus 2"),
        ({"jobs": [{**job, "epochs": 2, "epochs_done": 2}]}, "epochs_done 2 >= epochs 2"),
        (
            {
                "nodes": [{"name": f"m{i}", "free_gpus": 1} for i in range(32)],
                "jobs": [{"id": f"j{i}", "gpus": 1} for i in range(33)],
            },
            "33 jobs on 32 nodes",
        ),
        ({"policy": "p4-roofline"}, "needs forward_flops and memory_bytes"),
        (
            {"policy": "p2-elastic", "jobs": [{**job, "candidates": ["n1"]}]},
            "names candidates, which policy p2-elastic does not honour",
        ),
    ]:
        response = post(**changes)
        assert response.status_code == 409, (changes, response.text)
        detail = response.json()["detail"]
        assert isinstance(detail, str) and "\n" not in detail and words in detail, detail
    not_json = api.post("/v1/schedule", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 422
    anonymous = httpx.post(f"{api.base_url}/v1/schedule", json={}, timeout=30)
    assert anonymous.status_code == 401  # the token, as on every /v1 route


def test_p4_with_node_hardware_and_a_model(api: httpx.Client) -> None:
    hardware = {"peak_flops": 1.5e13, "memory_bandwidth": 9e11, "network_bits_per_s": 2.5e10}
    body = {
        "policy": "p4-roofline",
        "nodes": [{"name": "n1", "free_gpus": 4, **hardware}],
        "jobs": [{"id": "r", "gpus": 2, "model": {"name": "resnet50"}}],
    }
    response = api.post("/v1/schedule", json=body)
    assert response.status_code == 200, response.text
    assert decided(response.json()) == {"r": ("start", {"n1": 2})}


def test_every_policy_answers_and_the_batch_applies(api: httpx.Client) -> None:
    """Whatever the policy, applying its batch (releases first, then placements) never puts
    more on a node than it has, and every job gets exactly one decision."""
    policies = api.get("/v1/placement/policies").json()["policies"]
    nodes = {"n1": 2, "n2": 4, "n3": 0}
    jobs = [
        {"id": "r1", "gpus": 4, "max_gpus": 8, "placement": [{"node": "n3", "gpus": 4}]},
        {
            "id": "r2",
            "gpus": 3,
            "placement": [{"node": "n3", "gpus": 2}, {"node": "n1", "gpus": 1}],
        },
        {"id": "w1", "gpus": 2, "dataset": "imagenet", "qos": "prior", "arrival": 5},
        {"id": "w2", "gpus": 3, "max_gpus": 6, "qos": "urgent", "arrival": 6},
        {"id": "w3", "gpus": 1, "arrival": 7},
    ]
    capacity = {"n1": 3, "n2": 4, "n3": 6}
    for policy in policies:
        if policy.startswith("p4-roofline"):
            continue  # needs node hardware (above)
        answer = schedule(api, policy, nodes, jobs, now=100)
        used = dict.fromkeys(capacity, 0)
        for decision in answer["decisions"]:
            running = any(job["id"] == decision["job"] and job.get("placement") for job in jobs)
            allowed = {"keep", "resize", "preempt"} if running else {"start", "wait"}
            assert decision["action"] in allowed, (policy, decision)
            assert decision["gpus"] == sum(p["gpus"] for p in decision["placement"])
            for part in decision["placement"]:
                used[part["node"]] += part["gpus"]
        assert all(used[n] <= capacity[n] for n in capacity), (policy, used)


def test_the_spec_has_the_route_and_its_examples_are_answered(api: httpx.Client) -> None:
    spec = api.get("/openapi.json").json()
    operation = spec["paths"]["/v1/schedule"]["post"]
    assert {"200", "409", "422"} <= set(operation["responses"])
    schemas = spec["components"]["schemas"]
    policies = api.get("/v1/placement/policies").json()["policies"]
    assert schemas["ScheduleRequest"]["properties"]["policy"]["enum"] == policies
    examples = operation["requestBody"]["content"]["application/json"]["examples"]
    assert set(examples) >= {"fifo", "elastic"}
    for example in examples.values():
        response = api.post("/v1/schedule", json=example["value"])
        assert response.status_code == 200, response.text
    elastic = decided(api.post("/v1/schedule", json=examples["elastic"]["value"]).json())
    assert elastic == {"big": ("resize", {"n1": 7}), "new": ("start", {"n1": 1})}
