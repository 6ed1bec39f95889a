"""A local HTTP server that answers the Kubernetes API requests the CacheScaler's client makes.

No Kubernetes API server can run on these machines, so this one speaks the real wire format of
the few requests the ``kubernetes`` client sends, and the tests drive the real client at it:

- ``GET /api/v1/pods``, ``GET /api/v1/namespaces/{ns}/pods``, ``GET /api/v1/nodes``: a list
  (``PodList``/``NodeList``) with ``metadata.resourceVersion``;
- the same with ``watch=true``: a chunked stream of newline-delimited JSON events
  ``{"type": "ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK", "object": {...}}`` from the given
  ``resourceVersion`` on, ended after ``timeoutSeconds``; a version older than the history kept
  (see :meth:`FakeKubeAPI.expire`) gets the API server's ``ERROR`` event with a ``410 Gone``
  Status, exactly as a real API server answers a watch from a compacted version;
- ``PATCH /api/v1/nodes/{name}`` with ``application/strategic-merge-patch+json`` or
  ``application/merge-patch+json``: applied as a JSON merge patch (RFC 7386), which is what a
  strategic merge patch does to maps such as labels and annotations; a JSON patch (a list of
  operations) is answered 415, as the scaler never sends one;
- a bearer token on every request (401 Status otherwise).

Every request is recorded (method, path, query, content type) for the tests to inspect.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

TOKEN = "kube-test-token"


def merge_patch(target, patch):
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeAPI:
    def __init__(self, token: str = TOKEN):
        self.token = token
        self._cond = threading.Condition(threading.RLock())
        self._version = 0  # the cluster-wide resourceVersion counter, as etcd's revision
        self._objects: dict[str, dict[tuple[str, str], dict]] = {"pods": {}, "nodes": {}}
        # (version, resource, event type, object): the watch history.
        self._history: list[tuple[int, str, str, dict]] = []
        self._expired_before = 0  # watches from a version below this get 410
        self._generation = 0  # bumped to end every open watch
        self._abort_generation = 0  # bumped to cut every open watch without its last chunk
        self.requests: list[dict] = []
        self.on_patch = None  # called as on_patch(node name, patch body) before it applies
        self.watches_expired = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubeAPI:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake kube api")
        self._thread.start()
        return self

    def close(self) -> None:
        self.end_watches()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    # --- objects -------------------------------------------------------------------------------

    def _write(self, resource: str, kind: str, obj: dict) -> dict:
        """Store (or delete) ``obj`` under a new resourceVersion and record the event."""
        with self._cond:
            self._version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self._version)
            meta = obj["metadata"]
            key = (meta.get("namespace", ""), meta["name"])
            if kind == "DELETED":
                self._objects[resource].pop(key, None)
            else:
                self._objects[resource][key] = obj
            self._history.append((self._version, resource, kind, obj))
            self._cond.notify_all()
            return copy.deepcopy(obj)

    def add_node(self, name: str, labels: dict | None = None) -> dict:
        obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "labels": labels or {},
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        return self._write("nodes", "ADDED", obj)

    def node(self, name: str) -> dict:
        with self._cond:
            return copy.deepcopy(self._objects["nodes"][("", name)])

    def labels(self, name: str) -> dict:
        return self.node(name)["metadata"].get("labels") or {}

    def annotations(self, name: str) -> dict:
        return self.node(name)["metadata"].get("annotations") or {}

    def add_pod(
        self,
        name: str,
        node: str | None,
        *,
        namespace: str = "training",
        dataset: str | None = None,
        phase: str = "Running",
        annotations: dict | None = None,
        labels: dict | None = None,
    ) -> dict:
        annotations = dict(annotations or {})
        if dataset is not None:
            annotations["cachefs.io/dataset"] = dataset
        obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "labels": labels or {},
                "annotations": annotations,
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"containers": [{"name": "train", "image": "trainer:1"}]},
            "status": {"phase": phase},
        }
        if node is not None:
            obj["spec"]["nodeName"] = node
        return self._write("pods", "ADDED", obj)

    def update_pod(self, name: str, namespace: str = "training", **status) -> dict:
        with self._cond:
            obj = copy.deepcopy(self._objects["pods"][(namespace, name)])
            obj["status"].update(status)
            return self._write("pods", "MODIFIED", obj)

    def delete_pod(self, name: str, namespace: str = "training") -> None:
        with self._cond:
            obj = self._objects["pods"][(namespace, name)]
            self._write("pods", "DELETED", obj)

    # --- faults --------------------------------------------------------------------------------

    def expire(self, change=None) -> None:
        """Run ``change`` (a callable that writes objects), then forget the whole history and
        end every open watch — all at once, so no watch delivers the change first. A client
        watching from any version it had is then answered 410 Gone and must list again."""
        with self._cond:
            if change is not None:
                change()
            self._expired_before = self._version + 1
            self._history.clear()
            self._generation += 1
            self._cond.notify_all()

    def end_watches(self) -> None:
        """End every open watch cleanly, as the API server does at ``timeoutSeconds``."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def cut_watches(self) -> None:
        """Drop every open watch's connection mid-stream (no final chunk): a network failure."""
        with self._cond:
            self._abort_generation += 1
            self._cond.notify_all()

    def count(self, method: str, path: str, *, watch: bool | None = None) -> int:
        with self._cond:
            return sum(
                1
                for r in self.requests
                if r["method"] == method
                and r["path"] == path
                and (watch is None or r["watch"] == watch)
            )

    # --- serving -------------------------------------------------------------------------------

    def _list(self, resource: str, namespace: str | None) -> dict:
        with self._cond:
            items = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self._objects[resource].items())
                if namespace is None or ns == namespace
            ]
            kind = "PodList" if resource == "pods" else "NodeList"
            return {
                "kind": kind,
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }


class _Abort(Exception):
    pass


def _handler(api: FakeKubeAPI):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send_json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[str, str | None, str | None, dict] | None:
            """(resource, namespace, name, query) of a supported path, else None."""
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            segments = parts.path.strip("/").split("/")
            with api._cond:
                api.requests.append(
                    {
                        "method": self.command,
                        "path": parts.path,
                        "query": query,
                        "content_type": self.headers.get("Content-Type"),
                        "watch": query.get("watch") in ("true", "1"),
                        "at": time.time(),
                    }
                )
            if self.headers.get("Authorization") != f"Bearer {api.token}":
                self._send_json(401, status(401, "Unauthorized", "Unauthorized"))
                return None
            if segments[:2] != ["api", "v1"]:
                self._send_json(404, status(404, "NotFound", "the server could not find it"))
                return None
            rest = segments[2:]
            if rest == ["pods"]:
                return "pods", None, None, query
            if len(rest) == 3 and rest[0] == "namespaces" and rest[2] == "pods":
                return "pods", rest[1], None, query
            if rest == ["nodes"]:
                return "nodes", None, None, query
            if len(rest) == 2 and rest[0] == "nodes":
                return "nodes", None, rest[1], query
            self._send_json(404, status(404, "NotFound", "the server could not find it"))
            return None

        def do_GET(self) -> None:
            route = self._route()
            if route is None:
                return
            resource, namespace, name, query = route
            if name is not None:
                with api._cond:
                    obj = api._objects[resource].get(("", name))
                if obj is None:
                    self._send_json(404, status(404, "NotFound", f'nodes "{name}" not found'))
                else:
                    self._send_json(200, obj)
                return
            if query.get("watch") in ("true", "1"):
                self._watch(resource, namespace, query)
            else:
                self._send_json(200, api._list(resource, namespace))

        def do_PATCH(self) -> None:
            route = self._route()
            if route is None:
                return
            resource, _, name, _ = route
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if resource != "nodes" or name is None:
                self._send_json(405, status(405, "MethodNotAllowed", "not supported here"))
                return
            if content_type not in (
                "application/strategic-merge-patch+json",
                "application/merge-patch+json",
            ):
                self._send_json(415, status(415, "UnsupportedMediaType", content_type))
                return
            patch = json.loads(body)
            if api.on_patch is not None:
                api.on_patch(name, patch)
            with api._cond:
                current = api._objects["nodes"].get(("", name))
                if current is None:
                    self._send_json(404, status(404, "NotFound", f'nodes "{name}" not found'))
                    return
                updated = merge_patch(current, patch)
                updated["metadata"]["name"] = name
                stored = api._write("nodes", "MODIFIED", updated)
            self._send_json(200, stored)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _watch(self, resource: str, namespace: str | None, query: dict) -> None:
            since = int(query.get("resourceVersion") or 0)
            deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
            bookmarks = query.get("allowWatchBookmarks") == "true"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with api._cond:
                generation, abort = api._generation, api._abort_generation
                if since < api._expired_before - 1:
                    api.watches_expired += 1
                    message = f"too old resource version: {since} ({api._expired_before - 1})"
                    error = {"type": "ERROR", "object": status(410, "Expired", message)}
                    self._chunk(json.dumps(error).encode() + b"\n")
                    self._chunk(b"")
                    return
                if since == 0:  # "any version": the current objects first, as ADDED events
                    pending = [
                        ("ADDED", obj)
                        for (ns, _), obj in sorted(api._objects[resource].items())
                        if namespace is None or ns == namespace
                    ]
                    since = api._version
                else:
                    pending = []
            try:
                while True:
                    for kind, obj in pending:
                        self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    with api._cond:
                        while True:
                            if api._abort_generation != abort:
                                raise _Abort
                            if api._generation != generation or time.monotonic() >= deadline:
                                if bookmarks:
                                    mark = {
                                        "kind": "Pod" if resource == "pods" else "Node",
                                        "apiVersion": "v1",
                                        "metadata": {"resourceVersion": str(since)},
                                    }
                                    line = {"type": "BOOKMARK", "object": mark}
                                    self._chunk(json.dumps(line).encode() + b"\n")
                                self._chunk(b"")
                                return
                            pending = [
                                (kind, obj)
                                for version, res, kind, obj in api._history
                                if version > since
                                and res == resource
                                and (
                                    namespace is None
                                    or obj["metadata"].get("namespace") == namespace
                                )
                            ]
                            if pending:
                                since = max(
                                    int(o["metadata"]["resourceVersion"]) for _, o in pending
                                )
                                break
                            api._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            except _Abort:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    return Handler
