"""The worker's link to the coordinator: heartbeats out, the cluster view back.

Every interval the agent sends this node's report (peer address, tier usage, cached bytes per
dataset and shard, last read per dataset, preload and fill progress, cleanup tasks done) and
gets the view: live membership per copy and the copies being filled (→ the shard owners and
fill sources the read path uses, and the filler), the datasets the node must serve (→ added,
removed, refreshed here), the running preload jobs (→ the preloader) and this node's cleanup
tasks (→ the task runner, once the membership of the same view is applied). The coordinator
being down changes nothing: the last view stays in force, reads go on, and heartbeats resume
when it is back.

Datasets are reconciled in a task of their own, because building a snapshot can take many
seconds and heartbeats must not stop meanwhile (the node would be marked down). Whenever the
datasets served here change (this reconciliation, or a dataset the worker opened by itself),
the preloader and the filler are told, so work that waits for its dataset starts then.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import trio

from cachefs.client import ControlError, CoordinatorClient, CoordinatorUnavailable
from cachefs.errors import CachefsError
from cachefs.protocol import DatasetSpec

from .fill import Filler
from .membership import Membership
from .preload import Preloader
from .tasks import TaskRunner

log = logging.getLogger("cachefs.cluster")

RETRY_AFTER_S = 30.0


class ClusterWorker(Protocol):
    """What the agent needs from the worker."""

    def cluster_report(self) -> dict[str, Any]: ...
    def served_datasets(self) -> dict[str, int]:
        """Datasets served here → the refresh epoch their snapshot was built for."""
        ...

    async def add_followed_dataset(self, spec: DatasetSpec, refresh_epoch: int) -> None: ...
    async def remove_followed_dataset(self, name: str) -> None: ...
    async def refresh_followed_dataset(self, name: str, refresh_epoch: int) -> None: ...


class ClusterAgent:
    def __init__(
        self,
        worker: ClusterWorker,
        client: CoordinatorClient,
        node: str,
        membership: Membership,
        preloader: Preloader,
        filler: Filler,
        tasks: TaskRunner,
        *,
        state_dir: str,
        interval_s: float = 2.0,
    ):
        self.worker = worker
        self.client = client
        self.node = node
        self.membership = membership
        self.preloader = preloader
        self.filler = filler
        self.tasks = tasks
        self.interval_s = interval_s
        self.connected = False
        self.last_view: dict[str, Any] | None = None
        self.last_error: str | None = None
        self._cluster_id_file = os.path.join(state_dir, "cluster-id")
        self._reconcile_wanted = trio.Event()
        self._failed_at: dict[str, float] = {}  # dataset -> when adding/refreshing it failed
        self._served_known: dict[str, int] = {}  # served datasets as last told to the workers

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reconcile_loop)
            task_status.started()
            while True:
                await self.beat()
                await trio.sleep(self.interval_s)

    async def beat(self) -> None:
        report = self.worker.cluster_report()
        report["preloads"] = self.preloader.reports()
        report["fills"] = self.filler.reports()
        report["tasks_done"] = self.tasks.reports()
        try:
            view = await trio.to_thread.run_sync(self.client.heartbeat, self.node, report)
        except (CoordinatorUnavailable, ControlError) as exc:
            if self.connected or self.last_error is None:
                log.warning("heartbeat failed (serving on with the last view): %s", exc)
            self.connected = False
            self.last_error = str(exc)
            return
        if not self.connected:
            log.info("connected to the coordinator at %s", self.client.url)
        self.connected, self.last_error = True, None
        self.last_view = view
        self.interval_s = view.get("heartbeat_interval_s", self.interval_s)
        if self.membership.update(view):
            log.info("membership changed: shard owners recomputed")
        live = {d["spec"]["name"]: d["copies"] for d in view["datasets"]}
        self.preloader.assign(view["preloads"], live)
        self.filler.assign(self.membership.fill_assignments())
        self.tasks.assign(view.get("tasks") or [])  # after the membership: trims depend on it
        self._reconcile_wanted.set()

    def _same_cluster(self, cluster_id: str) -> bool:
        """Remember the cluster this state directory belongs to. A coordinator with another id
        (say, restarted on an empty state directory) must not make this node drop its
        datasets and their caches: removals are refused until an operator sorts it out."""
        try:
            with open(self._cluster_id_file) as f:
                known = f.read().strip()
        except FileNotFoundError:
            with open(self._cluster_id_file, "w") as f:
                f.write(cluster_id)
            return True
        return known == cluster_id

    async def _reconcile_loop(self) -> None:
        while True:
            await self._reconcile_wanted.wait()
            self._reconcile_wanted = trio.Event()
            if self.last_view is not None:
                await self._reconcile(self.last_view)
            self._tell_served()

    def _tell_served(self) -> None:
        """Wake the preloads and fills waiting for a dataset if what is served here changed."""
        served = self.worker.served_datasets()
        if served != self._served_known:
            self._served_known = served
            self.preloader.datasets_changed()
            self.filler.datasets_changed()

    async def _reconcile(self, view: dict[str, Any]) -> None:
        wanted = {d["spec"]["name"]: d for d in view["datasets"]}
        served = self.worker.served_datasets()
        same_cluster = self._same_cluster(view["cluster_id"])
        for name, dataset in wanted.items():
            epoch = dataset["refresh_epoch"]
            if trio.current_time() - self._failed_at.get(name, -RETRY_AFTER_S) < RETRY_AFTER_S:
                continue  # a source that failed (bad credentials, store down): not every beat
            try:
                if name not in served:
                    spec = DatasetSpec.from_json(
                        {**dataset["spec"], "slot": 0, "generation": 0, "extra": {}}
                    )
                    await self.worker.add_followed_dataset(spec, epoch)
                elif served[name] < epoch:
                    await self.worker.refresh_followed_dataset(name, epoch)
                else:
                    continue
                self._tell_served()  # now, not after the other datasets: they may take long
            except CachefsError as exc:
                self._failed_at[name] = trio.current_time()
                log.error("dataset %r: %s (retrying in %.0f s)", name, exc, RETRY_AFTER_S)
        for name in served.keys() - wanted.keys():
            if not same_cluster:
                log.error(
                    "the coordinator belongs to another cluster (id %s): not removing %r",
                    view["cluster_id"],
                    name,
                )
                continue
            try:
                await self.worker.remove_followed_dataset(name)
            except CachefsError as exc:
                log.error("removing dataset %r: %s", name, exc)
