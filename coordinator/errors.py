"""Refusals of the coordinator's model that depend on the cluster's state, not on the request's
form: the API answers them 404 and 409 (:func:`coordinator.api._status_of`), never 400.

A request the spec allows is either served, or refused because of what the cluster holds now
(a copy that does not exist, too few live nodes, a node already in another copy); anything a
request's form alone decides is in the spec, and refused there (422). They subclass
:class:`~cachefs.errors.ConfigError`, so in-process callers that catch the user's mistakes keep
catching them.
"""

from __future__ import annotations

from cachefs.errors import ConfigError


class CopyNotFound(ConfigError):
    """The dataset has no copy of that id (404)."""


class NoPreloadJob(ConfigError):
    """The dataset exists but no preload job of it was ever started (409: start one first)."""


class StateConflict(ConfigError):
    """The request is well formed but the cluster cannot do it now (409): e.g. a job wants more
    live nodes than there are, or a scale adds a node that belongs to another copy."""
