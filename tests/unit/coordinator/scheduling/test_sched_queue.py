"""``coordinator.scheduling.queue_api.decide`` on generated queues: every policy answers every
consistent queue (or refuses it as a conflict), one decision per job, and its batch applies:
releases first, then placements, never more on a node than it has, never twice the same."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.scheduling.model import Dataset, SchedulingError
from coordinator.scheduling.queue_api import LiveLocality, ScheduleRequest, decide
from coordinator.scheduling.registry import POLICY_NAMES

NODES = ("a", "b", "c", "d")
LIVE = LiveLocality(
    {"ds": Dataset("ds", 1000, {"a": 600, "c": 400}, (frozenset({"a", "c"}),))},
    {name: (2000, 500) for name in NODES},
)


@st.composite
def queues(draw) -> dict:
    free = {name: draw(st.integers(0, 8)) for name in NODES[: draw(st.integers(1, len(NODES)))]}
    room = dict(free)
    jobs = []
    for index in range(draw(st.integers(0, 7))):
        gpus = draw(st.integers(1, 8))
        job = {
            "id": f"j{index}",
            "gpus": gpus,
            "arrival": draw(st.sampled_from([0.0, 10.0, 50.0])),
            "qos": draw(st.sampled_from(["urgent", "prior", "normal"])),
            "epochs": draw(st.sampled_from([0.5, 1.0, 30.0])),
            "attained_gpu_s": draw(st.sampled_from([0.0, 5000.0, 50000.0])),
        }
        if draw(st.booleans()):
            job["max_gpus"] = gpus + draw(st.integers(0, 8))
        if draw(st.booleans()):
            job["dataset"] = draw(st.sampled_from(["ds", "other"]))
        if draw(st.booleans()):
            job["model"] = {"name": draw(st.sampled_from(["resnet50", "vgg16", "lstm"]))}
        if draw(st.integers(0, 3)) == 0:
            job["candidates"] = draw(st.lists(st.sampled_from(NODES), min_size=1, unique=True))
        if draw(st.booleans()):
            # Running: some GPUs it holds, counted on top of the free ones.
            holds = draw(st.integers(1, job.get("max_gpus", gpus)))
            node = draw(st.sampled_from(sorted(free)))
            room[node] += holds
            job["placement"] = [{"node": node, "gpus": holds}]
            job["epochs_done"] = job["epochs"] / 2
            if draw(st.booleans()):
                job["observations"] = [{"gpus": holds, "epoch_s": 120.0}]
        jobs.append(job)
    return {
        "policy": draw(st.sampled_from(POLICY_NAMES)),
        "now": 100.0,
        "nodes": [{"name": name, "free_gpus": count} for name, count in free.items()],
        "jobs": jobs,
        "_room": room,
    }


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(queues())
def test_every_policy_answers_and_its_batch_applies(body: dict) -> None:
    room = body.pop("_room")
    request = ScheduleRequest.model_validate(body)
    try:
        answer = decide(request, LIVE)
    except SchedulingError as err:
        # Refused as a conflict (a 409): a job asking more than its nodes have, candidates for
        # a policy that places on every node, or P4 without hardware facts; nothing else.
        words = ("asks for", "does not honour", "p4-roofline needs")
        assert any(w in str(err) for w in words), err
        return
    assert [d.job for d in answer.decisions] == [job["id"] for job in body["jobs"]]
    used = dict.fromkeys(room, 0)
    for decision, job in zip(answer.decisions, body["jobs"], strict=True):
        running = bool(job.get("placement"))
        assert decision.action in ({"keep", "resize", "preempt"} if running else {"start", "wait"})
        assert decision.gpus == sum(p.gpus for p in decision.placement)
        assert (decision.gpus > 0) == (decision.action in ("keep", "resize", "start"))
        for part in decision.placement:
            used[part.node] += part.gpus
            if "candidates" in job and decision.action != "keep":
                assert part.node in job["candidates"]
    assert all(used[node] <= room[node] for node in room), (used, room)
    assert decide(request, LIVE) == answer  # deterministic


def test_themis_puts_a_running_job_holding_more_than_its_demand_back_on_its_demand() -> None:
    """Themis gang-schedules every job on its demand. A running elastic job that holds more
    (4 GPUs, asks 1) is granted its 1 GPU when its lease is up, and the 3 others go to the
    waiting job: both fit (it once kept all 4 and failed with "grants exceed the pool")."""
    for policy in ("p5-themis", "p5-themis+locality"):
        body = {
            "policy": policy,
            "now": 100.0,
            "nodes": [{"name": "a", "free_gpus": 0}],
            "jobs": [
                {
                    "id": "elastic",
                    "gpus": 1,
                    "max_gpus": 4,
                    "placement": [{"node": "a", "gpus": 4}],
                    "epochs_done": 0.5,
                },
                {"id": "new", "gpus": 3},
            ],
        }
        answer = decide(ScheduleRequest.model_validate(body), LIVE)
        actions = [(d.job, d.action, d.gpus) for d in answer.decisions]
        assert actions == [("elastic", "resize", 1), ("new", "start", 3)], (policy, answer)
