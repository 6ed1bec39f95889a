"""What the CacheManager asks of workers (tasks) and what it did (events), both durable.

A task (``free`` a dataset's blocks, ``trim`` the listed shards) is sent in its node's heartbeat
replies until the node acknowledges it in a heartbeat, with the bytes it freed. Events are the
CacheManager's log for ``GET /v1/events``: the newest :data:`EVENTS_KEPT` are kept in the store.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ..json_types import JsonDoc
from ..model import ClusterModel

log = logging.getLogger("coordinator.manager")

EVENTS_KEPT = 1000


@dataclass
class Task:
    """Work for one worker, sent in its heartbeat replies until it acknowledges it."""

    id: str
    node: str
    kind: str  # "free": drop the dataset's blocks; "trim": drop the listed shards
    dataset: str
    reason: str
    created_at: float
    copy: str | None = None  # trim: the copy whose hand-off it ends
    shards: list[int] | None = None  # trim: the shards the node may drop (their owner holds them)

    def to_json(self) -> JsonDoc:
        return asdict(self)


class Journal:
    """The CacheManager's tasks and events (call under the model's lock)."""

    def __init__(self, model: ClusterModel) -> None:
        self.model = model
        self.tasks: dict[str, Task] = {}
        for doc in model.load("tasks/"):
            task = Task(**doc)
            self.tasks[task.id] = task
        self.events: deque[JsonDoc] = deque(model.load("events/"), maxlen=EVENTS_KEPT)
        #: (dataset, task kind) -> bytes workers freed since the coordinator started.
        self.freed_bytes: dict[tuple[str, str], int] = {}

    # --- tasks ---------------------------------------------------------------------------------

    def add_task(
        self,
        node: str,
        kind: str,
        dataset: str,
        reason: str,
        *,
        copy: str | None = None,
        shards: list[int] | None = None,
    ) -> None:
        task = Task(
            f"t-{secrets.token_hex(6)}", node, kind, dataset, reason, self.model.now(), copy, shards
        )
        self.model.save(f"tasks/{task.id}", task.to_json())
        self.tasks[task.id] = task

    def drop_task(self, task: Task) -> None:
        self.model.delete(f"tasks/{task.id}")
        del self.tasks[task.id]

    def cancel_tasks(self, dataset: str, nodes: list[str]) -> None:
        """Nodes joining a copy keep their blocks: drop pending tasks of the dataset there."""
        for task in list(self.tasks.values()):
            if task.dataset == dataset and task.node in nodes:
                self.drop_task(task)

    def pending_trims(self, dataset: str, copy_id: str) -> list[Task]:
        """The trims of a copy not yet acknowledged."""
        return [
            task
            for task in self.tasks.values()
            if task.dataset == dataset and task.kind == "trim" and task.copy == copy_id
        ]

    def nodes_with_tasks(self) -> set[str]:
        return {task.node for task in self.tasks.values()}

    def tasks_for(self, node: str) -> list[JsonDoc]:
        """``node``'s pending tasks as its heartbeat reply lists them, oldest first."""
        tasks = [t for t in self.tasks.values() if t.node == node]
        return [
            {"id": t.id, "kind": t.kind, "dataset": t.dataset, "reason": t.reason}
            | ({"shards": t.shards} if t.shards is not None else {})
            for t in sorted(tasks, key=lambda t: t.created_at)
        ]

    def acknowledge(self, node: str, tasks_done: dict[str, JsonDoc]) -> None:
        """``node`` reports tasks done (``{task id: {"freed_bytes": n, "error": …}}``): they
        end, and what they freed is counted and logged. Another node's task is not this one's
        to end."""
        for task_id, result in tasks_done.items():
            task = self.tasks.get(task_id)
            if task is None or task.node != node:
                continue
            self.drop_task(task)
            freed = result.get("freed_bytes", 0)
            key = (task.dataset, task.kind)
            self.freed_bytes[key] = self.freed_bytes.get(key, 0) + freed
            error = result.get("error")
            self.event(
                "freed", task.dataset, None,
                f"{node} {'failed to free' if error else 'freed'} {freed} bytes of "
                f"{task.dataset} ({task.kind}: {task.reason})" + (f": {error}" if error else ""),
                node=node, freed_bytes=freed,
            )  # fmt: skip

    def freed_bytes_of(self, dataset: str) -> int:
        return sum(nbytes for (name, _), nbytes in self.freed_bytes.items() if name == dataset)

    def forget_dataset(self, dataset: str) -> None:
        for task in [t for t in self.tasks.values() if t.dataset == dataset]:
            self.drop_task(task)

    # --- events --------------------------------------------------------------------------------

    def event(
        self, kind: str, dataset: str, copy: str | None, message: str, **details: Any
    ) -> None:
        """Record what the CacheManager did and why (``GET /v1/events``)."""
        now = self.model.now()
        key = f"events/{int(now * 1000):013d}-{secrets.token_hex(3)}"
        event = {"id": key.removeprefix("events/"), "at": now, "kind": kind, "dataset": dataset,
                 "copy": copy, "message": message, **details}  # fmt: skip
        self.model.save(key, event)
        if len(self.events) == EVENTS_KEPT:
            self.model.delete(f"events/{self.events[0]['id']}")
        self.events.append(event)
        log.info("%s", message)

    def list_events(self, dataset: str | None = None, limit: int = 100) -> list[JsonDoc]:
        with self.model.lock:
            events = [e for e in self.events if dataset is None or e["dataset"] == dataset]
            return events[-limit:]
