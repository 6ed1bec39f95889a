"""A minimal ASGI app serving the placement endpoint.

The coordinator service (a later issue) will include
:func:`coordinator.scheduling.http.placement_router` in its own app; this factory lets the
endpoint run, and be tested, on its own with whatever locality and cluster sources the caller
supplies.
"""

from __future__ import annotations

from fastapi import FastAPI

from .docs import serve_docs_offline
from .scheduling.http import placement_router
from .scheduling.sources import ClusterSource, LocalitySource


def create_app(locality_source: LocalitySource, cluster_source: ClusterSource) -> FastAPI:
    """A FastAPI app with ``POST /v1/placement`` answering from the given sources."""
    app = FastAPI(title="cachefs placement", version="1", docs_url=None, redoc_url=None)
    serve_docs_offline(app)
    app.include_router(placement_router(locality_source, cluster_source))
    return app
