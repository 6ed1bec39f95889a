"""Python client for a worker's local control API (HTTP over its unix socket).

The CLI uses it, and so do other components (tf_dataset, the coordinator) — nobody else speaks
raw HTTP to a worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from cachefs.errors import CachefsError


def default_state_dir() -> str:
    """``$CACHEFS_STATE``, else /var/lib/cachefs for root, else ~/.local/state/cachefs."""
    env = os.environ.get("CACHEFS_STATE")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/cachefs"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "cachefs")


class WorkerNotRunning(CachefsError):
    pass


@dataclass(frozen=True)
class InvalidField:
    """One field of a request that the server's schema refused (a FastAPI 422 answer)."""

    field: str  # the body field, query parameter or path parameter, e.g. "fraction"
    problem: str  # pydantic's words, e.g. "input should be less than or equal to 1"
    given: str | None = None  # the value sent, as JSON, when the client knows it
    where: str = "body"  # "body", "query" or "path"

    def describe(self, name: str | None = None) -> str:
        """``name`` (default: the field) and the problem, e.g. ``--fraction: input should be
        less than or equal to 1 (got 1.5)``."""
        got = f" (got {self.given})" if self.given is not None else ""
        return f"{name or self.field}: {self.problem}{got}"


class ControlError(CachefsError):
    """The worker or the coordinator refused a request; ``str()`` is one line saying why.
    ``invalid`` names the fields a schema refused, so the CLI can name its options instead."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        kind: str = "",
        invalid: tuple[InvalidField, ...] = (),
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.invalid = invalid


def one_line(text: str, limit: int = 500) -> str:
    """``text`` on one line (every run of whitespace a single space), cut at ``limit``."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def refusal_of(
    response: httpx.Response, *, sent: dict[str, Any] | None = None, hint: str = ""
) -> ControlError:
    """The one mapping of an error answer (4xx/5xx) from a worker or the coordinator to a
    :class:`ControlError` with a one-line message. Bodies understood: the worker's
    ``{"error", "message"}``, the coordinator's ``{"detail": "…", "kind"}``, FastAPI's
    ``{"detail": [{"loc", "msg", …}]}`` for a request its schema refused (``sent`` supplies
    the values it names: ``{"body": <the JSON sent>, "query": <the parameters>}``), and plain
    text.
    ``hint`` is added to the message (what the user can do about it)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = response.text.strip() or response.reason_phrase or "no reason given"
        return ControlError(one_line(text) + hint, status=response.status_code)
    kind = str(body.get("error") or body.get("kind") or "")
    detail = body.get("message") or body.get("detail")
    if isinstance(detail, list) and all(isinstance(item, dict) for item in detail):
        invalid = tuple(_invalid_field(item, sent or {}) for item in detail)
        message = "invalid request: " + "; ".join(field.describe() for field in invalid)
        return ControlError(
            one_line(message) + hint, status=response.status_code, kind=kind, invalid=invalid
        )
    return ControlError(
        one_line(str(detail or body)) + hint, status=response.status_code, kind=kind
    )


def _invalid_field(error: dict[str, Any], sent: dict[str, Any]) -> InvalidField:
    """One item of FastAPI's 422 ``detail``: ``loc`` is ("body"|"query"|"path", field, …)."""
    loc = [str(part) for part in error.get("loc") or ()]
    where, path = (loc[0], loc[1:]) if loc else ("body", [])
    field = next((part for part in path if not part.isdigit()), where)
    problem = str(error.get("msg") or error.get("type") or "invalid")
    problem = problem[:1].lower() + problem[1:]
    given = None
    if sent.get(where) is not None and path:
        value = sent[where]
        for part in path:
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                value = _MISSING
                break
        if value is not _MISSING:
            given = json.dumps(value)
    return InvalidField(field, problem, given, where)


_MISSING = object()


def _sent(request_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a request carried, by the ``loc`` names of FastAPI's validation errors."""
    return {"body": request_kwargs.get("json"), "query": request_kwargs.get("params")}


_Client = TypeVar("_Client", bound="_JSONCalls")


class _JSONCalls:
    """What both clients share: their HTTP client (closed by :meth:`close` or a ``with``
    block), and a call whose answer is the JSON document its route documents. ``_request``
    (each client's own) sends a call and returns its decoded answer."""

    _http: httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self: _Client) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """A call answered with a JSON object."""
        answer = self._request(method, path, **kwargs)
        if not isinstance(answer, dict):
            raise _unexpected_answer(method, path, "a JSON object", answer)
        return answer

    def _list(self, method: str, path: str, **kwargs: Any) -> list[dict[str, Any]]:
        """A call answered with a JSON array of objects."""
        answer = self._request(method, path, **kwargs)
        if not isinstance(answer, list):
            raise _unexpected_answer(method, path, "a JSON array", answer)
        return answer


def _unexpected_answer(method: str, path: str, wanted: str, answer: object) -> CachefsError:
    return CachefsError(
        f"{method} {path} answered {one_line(repr(answer), 200)} where {wanted} was expected "
        "(a worker or coordinator of another version?)"
    )


class PreloadCalls(_JSONCalls):
    """The preload routes, the same on a worker's control socket (single node) and on the
    coordinator (a cluster), so the CLI drives either client."""

    def preload(
        self,
        dataset: str,
        *,
        paths: list[str] | None = None,
        fraction: float | None = None,
        nbytes: int | None = None,
        at: float | None = None,
    ) -> dict[str, Any]:
        body = {"paths": paths or [], "fraction": fraction, "bytes": nbytes, "at": at}
        return self._object("POST", f"/v1/datasets/{dataset}/preload", json=body)

    def preload_status(self, dataset: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/datasets/{dataset}/preload")

    def resume_preload(self, dataset: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/datasets/{dataset}/preload/resume")

    def cancel_preload(self, dataset: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/datasets/{dataset}/preload/cancel")


class ControlClient(PreloadCalls):
    def __init__(self, state_dir: str | None = None, *, timeout: float = 600.0):
        self.state_dir = state_dir or default_state_dir()
        self.socket_path = os.path.join(self.state_dir, "worker.sock")
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=self.socket_path),
            base_url="http://cachefs-worker",
            timeout=timeout,
        )

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, FileNotFoundError) as exc:
            raise WorkerNotRunning(
                f"no cachefs worker is running for state directory {self.state_dir} "
                "(start one with `cachefs up`, or point --state / CACHEFS_STATE at it)"
            ) from exc
        except httpx.TransportError as exc:  # e.g. the worker is shutting down mid-request
            raise WorkerNotRunning(
                f"lost the connection to the cachefs worker of {self.state_dir}: {exc}"
            ) from exc
        if response.status_code >= 400:
            raise refusal_of(response, sent=_sent(kwargs))
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def is_running(self) -> bool:
        try:
            self.status()
        except WorkerNotRunning:
            return False
        return True

    def status(self) -> dict[str, Any]:
        return self._object("GET", "/v1/status")

    def datasets(self) -> list[dict[str, Any]]:
        return self._list("GET", "/v1/datasets")

    def add_dataset(self, spec: dict[str, Any], *, allow_empty: bool = False) -> dict[str, Any]:
        """Add a dataset; a source that lists no file is refused unless ``allow_empty``."""
        params = {"allow_empty": "true"} if allow_empty else None
        return self._object("POST", "/v1/datasets", json=spec, params=params)

    def remove_dataset(self, name: str, *, keep_cache: bool = False) -> dict[str, Any]:
        return self._object(
            "DELETE", f"/v1/datasets/{name}", params={"keep_cache": str(keep_cache).lower()}
        )

    def refresh_dataset(self, name: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/datasets/{name}/refresh")

    def resolve(self, dataset: str, path: str) -> dict[str, Any]:
        return self._object("GET", "/v1/resolve", params={"dataset": dataset, "path": path})

    def resolve_many(
        self, dataset: str, paths: list[str], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Per path its size and blocks, each cached block with its local file, length and
        xxh3_64 (see ``Worker.resolve_many``). At most 10,000 paths per call."""
        return self._object(
            "POST",
            f"/v1/datasets/{dataset}/resolve",
            json={"paths": list(paths)},
            timeout=timeout or self._http.timeout,
        )

    def prefetch(
        self, dataset: str, paths: list[str], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Tell the worker these files will be read soon: their uncached blocks are fetched in
        the background. Returns ``{"accepted", "dropped", "queued"}``."""
        return self._object(
            "POST",
            f"/v1/datasets/{dataset}/prefetch",
            json={"paths": list(paths)},
            timeout=timeout or self._http.timeout,
        )

    def shutdown(self) -> None:
        self._request("POST", "/v1/shutdown")

    def metrics(self) -> str:
        text = self._request("GET", "/metrics")
        if not isinstance(text, str):
            raise _unexpected_answer("GET", "/metrics", "Prometheus text", text)
        return text


# --- the coordinator -----------------------------------------------------------------------------

DEFAULT_COORDINATOR = "http://127.0.0.1:7700"


class CoordinatorUnavailable(CachefsError):
    pass


def coordinator_url(explicit: str | None = None) -> str | None:
    """``--coordinator``, else ``$CACHEFS_COORDINATOR``, else None (single-node mode)."""
    url = explicit or os.environ.get("CACHEFS_COORDINATOR") or None
    return url.rstrip("/") if url else None


def find_token(token_file: str | None = None, state_dir: str | None = None) -> str | None:
    """The API token: ``--token-file``, else ``$CACHEFS_TOKEN``, else the ``token`` file a
    coordinator generated in the state directory on this machine (None if there is none)."""
    if token_file:
        try:
            with open(token_file) as f:
                return f.read().strip() or None
        except OSError as exc:
            raise CachefsError(f"cannot read the token file {token_file}: {exc.strerror}") from None
    if os.environ.get("CACHEFS_TOKEN"):
        return os.environ["CACHEFS_TOKEN"].strip()
    path = os.path.join(state_dir or default_state_dir(), "token")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


class CoordinatorClient(PreloadCalls):
    """Client of the coordinator's HTTP API (blocking). Errors: :class:`CoordinatorUnavailable`
    when it cannot be reached, :class:`ControlError` (with ``.status``) when it refuses."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise CoordinatorUnavailable(
                f"cannot reach the cachefs coordinator at {self.url} ({type(exc).__name__}); "
                "is it running? (--coordinator / CACHEFS_COORDINATOR)"
            ) from exc
        if response.status_code >= 400:
            hint = (
                " (pass --token-file or set CACHEFS_TOKEN)" if response.status_code == 401 else ""
            )
            raise refusal_of(response, sent=_sent(kwargs), hint=hint)
        return response.json()

    def health(self) -> dict[str, Any]:
        return self._object("GET", "/healthz")

    def datasets(self) -> list[dict[str, Any]]:
        return self._list("GET", "/v1/datasets")

    def dataset(self, name: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/datasets/{name}")

    def add_dataset(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._object("POST", "/v1/datasets", json=spec)

    def remove_dataset(self, name: str) -> dict[str, Any]:
        return self._object("DELETE", f"/v1/datasets/{name}")

    def update_policy(self, name: str, **changes: Any) -> dict[str, Any]:
        """Change ``max_jobs_per_copy`` (None: no limit), ``overflow`` or ``cleanup``."""
        return self._object("PATCH", f"/v1/datasets/{name}", json=changes)

    def refresh_dataset(self, name: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/datasets/{name}/refresh")

    def locality(self, dataset: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/datasets/{dataset}/locality")

    def locality_document(self) -> dict[str, Any]:
        return self._object("GET", "/v1/locality")

    def nodes(self) -> list[dict[str, Any]]:
        return self._list("GET", "/v1/nodes")

    def node(self, name: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/nodes/{name}")

    def heartbeat(self, node: str, report: dict[str, Any]) -> dict[str, Any]:
        return self._object("POST", f"/v1/nodes/{node}/heartbeat", json=report)

    # --- jobs and copies (the CacheManager) -----------------------------------------------------

    def submit_job(
        self,
        job: str,
        dataset: str,
        nodes: int,
        *,
        candidates: list[str] | None = None,
        lease_s: float | None = None,
    ) -> dict[str, Any]:
        body = {"id": job, "dataset": dataset, "nodes": nodes, "candidates": candidates}
        if lease_s is not None:
            body["lease_s"] = lease_s
        return self._object("POST", "/v1/jobs", json=body)

    def jobs(self, dataset: str | None = None) -> list[dict[str, Any]]:
        params = {"dataset": dataset} if dataset else {}
        return self._list("GET", "/v1/jobs", params=params)

    def job(self, job: str, *, wait_s: float = 0) -> dict[str, Any]:
        """The job; with ``wait_s`` a long-poll that returns as soon as a suspended job is
        promoted (or after ``wait_s``), renewing its lease."""
        return self._object(
            "GET", f"/v1/jobs/{job}", params={"wait": wait_s}, timeout=self.timeout + wait_s
        )

    def renew_job(self, job: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/jobs/{job}/heartbeat")

    def release_job(self, job: str) -> dict[str, Any]:
        return self._object("DELETE", f"/v1/jobs/{job}")

    def scale(
        self, dataset: str, copy: str, *, add: Sequence[str] = (), remove: Sequence[str] = ()
    ) -> dict[str, Any]:
        body = {"add": list(add), "remove": list(remove)}
        return self._object("POST", f"/v1/datasets/{dataset}/copies/{copy}/scale", json=body)

    def events(self, dataset: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params = {"limit": limit, **({"dataset": dataset} if dataset else {})}
        return self._list("GET", "/v1/events", params=params)
