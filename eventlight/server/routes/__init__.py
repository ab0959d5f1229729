"""The ``/v1/agl`` routes, one module per resource; ``agl_router()`` joins them in match order."""

from __future__ import annotations

from fastapi import APIRouter

from eventlight.server.routes import resources, rollouts, spans, workers

__all__ = ["agl_router"]


def agl_router() -> APIRouter:
    """Every ``/v1/agl`` route (``/attempts/latest`` and ``/resources/latest`` before their ``{id}`` routes)."""
    router = APIRouter(prefix="/v1/agl")
    for module in (rollouts, resources, spans, workers):
        router.include_router(module.router)
    return router
