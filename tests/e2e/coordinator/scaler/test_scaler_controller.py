"""The CacheScaler end to end: the real ``kubernetes`` client against a local Kubernetes API
server, and a real coordinator process whose copies the scale calls change.

No Kubernetes API server can run on these machines, so ``kube_api.FakeKubeAPI`` — a local HTTP
server that answers the client's real requests in the real wire format (lists with
resourceVersion, chunked watch streams, 410 Gone for a compacted version, merge patches of
nodes) — stands in for one. cachefs workers are stood in for by ``HeartbeatingNodes``, which
send the worker's heartbeats to the real coordinator (that is how nodes appear there) and
report hand-offs done unless told to hold them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from coordinator.scaler.controller import Scaler, Settings
from coordinator.scaler.decide import ADDED_KEY, EVENT, LABELED_KEY, WORKER_LABEL, CopyChange
from tests.cluster_process import TOKEN, CoordinatorProcess, wait_for
from tests.e2e.coordinator.scaler.harness import GIB, HeartbeatingNodes, core_api, running
from tests.e2e.coordinator.scaler.kube_api import FakeKubeAPI
from tests.worker_process import REPO_ROOT

# The metric trigger off (a ratio is never above 1 nor below 0) unless a test turns it on.
EVENT_ONLY = Settings(
    metric_high=1.0,
    metric_low=0.0,
    resync_s=0.2,
    release_grace_s=0.0,
    watch_timeout_s=30,
    backoff_s=0.05,
    backoff_max_s=0.5,
)


@pytest.fixture
def kube():
    api = FakeKubeAPI().start()
    yield api
    api.close()


@pytest.fixture
def coordinator(tmp_path):
    process = CoordinatorProcess(str(tmp_path / "cluster")).start()
    yield process
    process.cleanup()


@pytest.fixture
def nodes(coordinator):
    with HeartbeatingNodes(coordinator.client) as heartbeats:
        yield heartbeats


def copy_nodes(coordinator, dataset="ds", copy="A") -> list[str]:
    doc = coordinator.client.dataset(dataset)
    return next(c["nodes"] for c in doc["copies"] if c["id"] == copy)


def wait_copy(coordinator, expected: list[str], dataset="ds", copy="A") -> None:
    wait_for(
        lambda: copy_nodes(coordinator, dataset, copy) == expected,
        f"copy {dataset}/{copy} == {expected}",
    )


def add_dataset(coordinator, tmp_path, nodes: list[str], name="ds") -> None:
    coordinator.client.add_dataset({"name": name, "uri": f"file://{tmp_path}", "nodes": nodes})


def test_event_trigger_labels_adds_and_releases_nodes(kube, coordinator, nodes, tmp_path):
    kube.add_node("n1", labels={WORKER_LABEL: "true"})  # an operator's worker node
    for name in ("n2", "n3", "n4"):
        kube.add_node(name)
    nodes.up("n1")
    nodes.up("n2")
    add_dataset(coordinator, tmp_path, ["n1"])
    # The copy, and the nodes its running hand-off reads from, when each label came off: the
    # label (hence the worker) must outlive both.
    when_unlabelled: dict[str, tuple[list[str], list[str]]] = {}

    def on_patch(node, patch):
        labels = patch.get("metadata", {}).get("labels") or {}
        if WORKER_LABEL in labels and labels[WORKER_LABEL] is None:
            [copy] = coordinator.client.dataset("ds")["copies"]
            fill = copy["fill"] or {"sources": [], "leaving": []}
            when_unlabelled[node] = (copy["nodes"], sorted(fill["sources"] + fill["leaving"]))

    kube.on_patch = on_patch
    scaler = Scaler(core_api(kube), coordinator.client, EVENT_ONLY)
    with running(scaler):
        kube.add_pod("unscheduled", None, dataset="ds", phase="Pending")
        kube.add_pod("other", "n4", annotations={"unrelated": "x"})
        kube.add_pod("p2", "n2", dataset="ds")
        wait_copy(coordinator, ["n1", "n2"])
        assert kube.labels("n2")[WORKER_LABEL] == "true"
        assert kube.annotations("n2")[LABELED_KEY] == "true"
        assert kube.annotations("n2")[ADDED_KEY] == "ds/A=event"

        # n3's worker has not registered: the node is labelled (so the DaemonSet can start
        # the worker) and joins the copy only once that worker is up at the coordinator.
        kube.add_pod("p3", "n3", dataset="ds", phase="Pending")
        wait_for(lambda: kube.labels("n3").get(WORKER_LABEL) == "true", "n3 labelled")
        assert copy_nodes(coordinator) == ["n1", "n2"]
        nodes.up("n3")
        wait_copy(coordinator, ["n1", "n2", "n3"])

        kube.update_pod("p2", phase="Succeeded")
        wait_copy(coordinator, ["n1", "n3"])
        wait_for(lambda: WORKER_LABEL not in kube.labels("n2"), "n2 unlabelled")
        assert ADDED_KEY not in kube.annotations("n2")
        assert LABELED_KEY not in kube.annotations("n2")

        kube.delete_pod("p3")
        wait_copy(coordinator, ["n1"])  # n1 was not the scaler's to remove
        wait_for(lambda: WORKER_LABEL not in kube.labels("n3"), "n3 unlabelled")

    assert when_unlabelled == {"n2": (["n1", "n3"], []), "n3": (["n1"], [])}
    assert kube.labels("n1") == {WORKER_LABEL: "true"}  # an operator's label stays
    assert "n4" not in when_unlabelled and WORKER_LABEL not in kube.labels("n4")
    patches = [r for r in kube.requests if r["method"] == "PATCH"]
    assert patches and {r["content_type"] for r in patches} == {
        "application/strategic-merge-patch+json"
    }


def test_pod_of_a_cachefs_job_joins_the_jobs_copy(kube, coordinator, nodes, tmp_path):
    """The job's copy comes from the coordinator's job list: here a clone (copy B) made when
    copy A reached its job limit."""
    for name in ("n1", "n2", "n3"):
        kube.add_node(name, labels={WORKER_LABEL: "true"})
        nodes.up(name)
    client = coordinator.client
    client.add_dataset(
        {
            "name": "ds",
            "uri": f"file://{tmp_path}",
            "nodes": ["n1"],
            "max_jobs_per_copy": 1,
            "overflow": "clone",
        }
    )
    assert client.submit_job("first", "ds", 1, candidates=["n1"])["copy"] == "A"
    assert client.submit_job("second", "ds", 1, candidates=["n2"])["copy"] == "B"
    scaler = Scaler(core_api(kube), client, EVENT_ONLY)
    with running(scaler):
        kube.add_pod("worker-1", "n3", dataset="ds", annotations={"cachefs.io/job": "second"})
        wait_copy(coordinator, ["n2", "n3"], copy="B")
        assert copy_nodes(coordinator, copy="A") == ["n1"]
        assert kube.annotations("n3")[ADDED_KEY] == "ds/B=event"


def test_watch_relists_after_410_and_resumes_after_a_dropped_connection(
    kube, coordinator, nodes, tmp_path
):
    for name in ("n1", "n2", "n3", "n4"):
        kube.add_node(name, labels={WORKER_LABEL: "true"})
        nodes.up(name)
    add_dataset(coordinator, tmp_path, ["n1"])
    scaler = Scaler(core_api(kube), coordinator.client, EVENT_ONLY)
    pods = scaler.pod_informers[0]
    with running(scaler):
        wait_for(lambda: scaler.stats["passes"] > 0, "the first pass")
        lists = kube.count("GET", "/api/v1/pods", watch=False)

        # The pod appears while the history the scaler's watch would resume from is compacted
        # away: only a new list can show it.
        kube.expire(lambda: kube.add_pod("p2", "n2", dataset="ds"))
        wait_copy(coordinator, ["n1", "n2"])
        assert kube.watches_expired >= 1
        assert pods.stats["expired"] >= 1
        assert kube.count("GET", "/api/v1/pods", watch=False) > lists

        # A connection cut mid-stream: the watch resumes from the last version, no new list.
        lists = kube.count("GET", "/api/v1/pods", watch=False)
        watches = kube.count("GET", "/api/v1/pods", watch=True)
        kube.cut_watches()
        kube.add_pod("p3", "n3", dataset="ds")
        wait_copy(coordinator, ["n1", "n2", "n3"])
        assert pods.stats["errors"] >= 1
        assert kube.count("GET", "/api/v1/pods", watch=True) > watches
        assert kube.count("GET", "/api/v1/pods", watch=False) == lists

        # A watch the server ends (its timeoutSeconds) is simply started again.
        kube.end_watches()
        kube.add_pod("p4", "n4", dataset="ds")
        wait_copy(coordinator, ["n1", "n2", "n3", "n4"])


def test_busy_copy_is_retried_until_its_hand_off_finishes(kube, coordinator, nodes, tmp_path):
    for name in ("n1", "n2", "n3"):
        kube.add_node(name, labels={WORKER_LABEL: "true"})
        nodes.up(name)
    add_dataset(coordinator, tmp_path, ["n1"])
    nodes.hold_fills(True)
    scaler = Scaler(core_api(kube), coordinator.client, EVENT_ONLY)
    with running(scaler):
        kube.add_pod("p2", "n2", dataset="ds")
        wait_copy(coordinator, ["n1", "n2"])  # this scale starts a hand-off that does not end
        kube.add_pod("p3", "n3", dataset="ds")
        wait_for(lambda: scaler.stats["scale_busy"] >= 2, "two refused (409) scale calls")
        assert copy_nodes(coordinator) == ["n1", "n2"]
        nodes.hold_fills(False)
        wait_copy(coordinator, ["n1", "n2", "n3"])


def test_unknown_node_is_refused_then_its_record_dropped_and_the_add_retried(
    kube, coordinator, nodes, tmp_path
):
    """The coordinator answers 404 (NodeNotFound) for a node whose worker never registered:
    the scale is left for later; the ownership record written before the call names a node
    outside the copy, so the next pass drops it."""
    kube.add_node("n1", labels={WORKER_LABEL: "true"})
    kube.add_node("n9", labels={WORKER_LABEL: "true"})
    nodes.up("n1")
    add_dataset(coordinator, tmp_path, ["n1"])
    idle = Scaler(core_api(kube), coordinator.client, EVENT_ONLY)  # its loop is not running
    assert not idle.apply_change(CopyChange(("ds", "A"), add={"n9": EVENT}), now=0.0)
    assert idle.stats["scale_not_found"] == 1
    assert copy_nodes(coordinator) == ["n1"]
    assert kube.annotations("n9")[ADDED_KEY] == "ds/A=event"

    scaler = Scaler(core_api(kube), coordinator.client, EVENT_ONLY)
    with running(scaler):
        wait_for(lambda: ADDED_KEY not in kube.annotations("n9"), "the stale record dropped")
        kube.add_pod("p9", "n9", dataset="ds")
        nodes.up("n9")
        wait_copy(coordinator, ["n1", "n9"])
        assert kube.annotations("n9")[ADDED_KEY] == "ds/A=event"


def test_metric_trigger_scales_out_and_in_with_hysteresis(kube, coordinator, nodes, tmp_path):
    for name in ("n1", "n2", "n3"):
        kube.add_node(name, labels={WORKER_LABEL: "true"})
    nodes.up("n1", capacity=10 * GIB, used=int(9.5 * GIB))
    nodes.up("n2", capacity=8 * GIB)
    nodes.up("n3", capacity=20 * GIB, used=10 * GIB)  # the most free cache: chosen
    add_dataset(coordinator, tmp_path, ["n1"])
    settings = Settings(
        metric_high=0.9,
        metric_low=0.5,
        metric_window_s=0.6,
        metric_interval_s=0.1,
        metric_cooldown_s=0.3,
        resync_s=0.1,
        release_grace_s=0.0,
        backoff_s=0.05,
    )
    scaler = Scaler(core_api(kube), coordinator.client, settings)
    with running(scaler):
        wait_copy(coordinator, ["n1", "n3"])
        assert kube.annotations("n3")[ADDED_KEY] == "ds/A=metric"
        out_at = recorded_action_after(scaler, None)

        def watched_a_window_since(action_at: float) -> bool:
            """The scaler's own samples, all taken after the action's cooldown, cover a whole
            window: the pass that took the last one judged them (its clock, not ours)."""
            history = scaler.metric_history(("ds", "A"))
            start = action_at + settings.metric_cooldown_s
            inside = [t for t, _ in history.samples if t >= start]
            return bool(inside) and inside[-1] - inside[0] >= settings.metric_window_s

        # Now (9.5 + 10) / 30 = 0.65, between low and high: nothing may change.
        wait_for(lambda: watched_a_window_since(out_at), "a window in the band")
        assert scaler.metric_history(("ds", "A")).last_action_at == out_at
        assert copy_nodes(coordinator) == ["n1", "n3"]

        nodes.set_used("n1", 1 * GIB)
        nodes.set_used("n3", 1 * GIB)
        wait_copy(coordinator, ["n1"])  # the node the metric trigger added goes
        wait_for(lambda: ADDED_KEY not in kube.annotations("n3"), "n3's record dropped")
        assert kube.labels("n3") == {WORKER_LABEL: "true"}  # the operator's label stays
        in_at = recorded_action_after(scaler, out_at)
        # 1 / 10 is still low, but n1 is not the metric trigger's to remove.
        wait_for(lambda: watched_a_window_since(in_at), "a low window at one node")
        assert copy_nodes(coordinator) == ["n1"]
    assert scaler.stats["scaled"] == 2


def recorded_action_after(scaler: Scaler, previous: float | None) -> float:
    """When the scaler recorded its next metric action on ds/A. The scaler records an action
    after the coordinator's scale call returns, so a test that saw the copy change can get
    there first (on a loaded machine it did): wait for the record, do not read it at once."""

    def recorded() -> bool:
        history = scaler.metric_history(("ds", "A"))
        return history is not None and history.last_action_at not in (None, previous)

    wait_for(recorded, "the scaler to record its action")
    return scaler.metric_history(("ds", "A")).last_action_at


def _kubeconfig(path, kube: FakeKubeAPI) -> str:
    text = f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{kube.url}"}}
users:
- name: scaler
  user: {{token: "{kube.token}"}}
contexts:
- name: fake
  context: {{cluster: fake, user: scaler}}
current-context: fake
"""
    path.write_text(text)
    return str(path)


def test_command_line_dry_run_changes_nothing(kube, coordinator, nodes, tmp_path):
    """``python -m coordinator.scaler`` with a kubeconfig: reads everything, logs what it would
    do, patches and scales nothing; SIGTERM stops it cleanly."""
    kube.add_node("n1", labels={WORKER_LABEL: "true"})
    kube.add_node("n2")
    nodes.up("n1")
    nodes.up("n2")
    add_dataset(coordinator, tmp_path, ["n1"])
    kube.add_pod("p2", "n2", dataset="ds")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    log_path = tmp_path / "scaler.log"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    args = [
        sys.executable,
        "-m",
        "coordinator.scaler",
        "--coordinator",
        coordinator.url,
        "--token-file",
        str(token_file),
        "--kubeconfig",
        _kubeconfig(tmp_path / "kc", kube),
        "--namespace",
        "training",
        "--resync",
        "0.2s",
        "--dry-run",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: b"dry run: would scale ds/A: add ['n2']" in log_path.read_bytes(),
            "the dry run's plan",
            timeout=30,
        )
        assert b"dry run: would patch node n2: label cachefs.io/worker=true" in (
            log_path.read_bytes()
        )
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
    assert returncode == 0, log_path.read_text()
    assert copy_nodes(coordinator) == ["n1"]
    assert kube.labels("n2") == {}
    assert kube.count("PATCH", "/api/v1/nodes/n2") == 0
    assert kube.count("GET", "/api/v1/namespaces/training/pods", watch=True) >= 1


def test_command_line_refuses_bad_settings(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    base = [sys.executable, "-m", "coordinator.scaler", "--coordinator", "http://127.0.0.1:9"]
    bad_bounds = subprocess.run(
        [*base, "--metric-high", "0.4", "--metric-low", "0.5"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad_bounds.returncode == 2 and "--metric-low must be below" in bad_bounds.stderr
    token_file = tmp_path / "token"
    token_file.write_text("t")
    no_config = subprocess.run(
        [*base, "--token-file", str(token_file), "--kubeconfig", str(tmp_path / "missing")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert no_config.returncode == 2 and "no Kubernetes configuration" in no_config.stderr
