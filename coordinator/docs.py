"""The browsable API docs (Swagger UI at ``/docs``, ReDoc at ``/redoc``) served with their
assets from this process, so they work where no CDN can be reached (FastAPI's own pages load
them from one and are blank offline).

The assets are the Swagger UI 5 and ReDoc bundles that the ``fastapi-offline`` package ships
(Swagger UI 5 renders the OpenAPI 3.1 FastAPI writes). The pages are FastAPI's own, pointed at
them; Swagger UI's spec validator badge, which calls a public service, is turned off.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"


def serve_docs_offline(app: FastAPI) -> None:
    """Add ``/docs``, ``/redoc`` and their assets to ``app`` (created with ``docs_url=None,
    redoc_url=None``); none of them is in the spec."""
    app.mount(ASSETS_URL, StaticFiles(directory=_ASSETS_DIR), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
