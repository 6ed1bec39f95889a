"""The coordinator's errors and the one mapping of errors to HTTP statuses (:func:`http_status`).

Every refusal of the coordinator's model is a :class:`~cachefs.errors.CachefsError` whose
message is one complete sentence; the API's one exception handler (:func:`coordinator.api.
create_app`) answers it ``{"detail": message, "kind": class name}`` with the status below.
The first row that matches wins:

======  ===================================================================================
status  errors
======  ===================================================================================
404     no such dataset, node, copy, job or preload job: :class:`~cachefs.errors.
        DatasetNotFound`, :class:`NodeNotFound`, :class:`CopyNotFound`, :class:`JobNotFound`,
        :class:`PreloadNotFound`
409     the request conflicts with what the cluster holds now: :class:`~cachefs.errors.
        DatasetExists`, :class:`JobExists`, :class:`CopyBusy`, :class:`StateConflict`,
        :class:`NoPreloadJob`
503     the state store is unavailable: :class:`~coordinator.state.StateStoreError`
400     a domain rule refused the request's values: any other
        :class:`~cachefs.errors.ConfigError` (``ValueError``'s role: the caller can fix it)
500     anything else: an error the coordinator did not expect is its own fault, not the
        caller's (the HTTP norm; the worker's control API, ``cachefs.control``, answers the
        same default)
======  ===================================================================================

What a request's form alone decides is in the OpenAPI spec and refused there (422, FastAPI's
validation) before any of these can arise; a request the spec allows is served, or refused for
the cluster's state (404, 409, 503). Exceptions that are no ``CachefsError`` (a bug) reach
FastAPI's own handler, which answers 500 too.

The placement and queue routers (:mod:`coordinator.scheduling.http`,
:mod:`coordinator.scheduling.queue_api`) also serve on their own (:mod:`coordinator.app`), so
they map their :class:`~coordinator.scheduling.model.SchedulingError` inside the route: 503 for
a locality source that cannot be read, 404 for an unknown dataset or node, 409 for a request
the policy cannot decide.

The 404/409 errors of the model subclass :class:`~cachefs.errors.ConfigError` where they are the
user's mistake, so in-process callers that catch the user's mistakes keep catching them.
"""

from __future__ import annotations

from cachefs.errors import CachefsError, ConfigError, DatasetExists, DatasetNotFound

from .state import StateStoreError


class NodeNotFound(CachefsError):
    """No registered node of that name (404)."""


class PreloadNotFound(CachefsError):
    """No preload job of that id, or the dataset has none (404; the dataset routes turn the
    latter into :class:`NoPreloadJob`)."""


class JobNotFound(CachefsError):
    """No job of that id: never submitted, or released (404)."""


class JobExists(CachefsError):
    """A job of that id exists with another request (409)."""


class CopyBusy(CachefsError):
    """The copy is still being filled (a clone or an earlier scale's hand-off) (409)."""


class CopyNotFound(ConfigError):
    """The dataset has no copy of that id (404)."""


class NoPreloadJob(ConfigError):
    """The dataset exists but no preload job of it was ever started (409: start one first)."""


class StateConflict(ConfigError):
    """The request is well formed but the cluster cannot do it now (409): e.g. a job wants more
    live nodes than there are, or a scale adds a node that belongs to another copy."""


#: The mapping of the module's docstring, in its order (the first match wins).
HTTP_STATUSES: tuple[tuple[tuple[type[CachefsError], ...], int], ...] = (
    ((DatasetNotFound, NodeNotFound, CopyNotFound, JobNotFound, PreloadNotFound), 404),
    ((DatasetExists, JobExists, CopyBusy, StateConflict, NoPreloadJob), 409),
    ((StateStoreError,), 503),
    ((ConfigError,), 400),
)
#: What any other error is answered: the coordinator's fault, not the request's.
UNEXPECTED_STATUS = 500


def http_status(exc: CachefsError) -> int:
    """The HTTP status the API answers ``exc`` with (see the module's docstring)."""
    for kinds, status in HTTP_STATUSES:
        if isinstance(exc, kinds):
            return status
    return UNEXPECTED_STATUS
