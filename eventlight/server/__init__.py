"""The store over HTTP: ``eventlight serve``, ``LightningStoreServer`` and ``LightningStoreClient``.

Modules: ``app`` (the FastAPI app), ``routes/`` (Agent-lightning 0.3.0's ``/v1/agl`` routes, one
module per resource), ``otlp``/``otlp_wire``/``otlp_spans`` (OTLP/HTTP ``/v1/traces``), ``models``
(request bodies), ``codec`` (JSON and OpenAPI), ``errors`` (the error tree as HTTP statuses),
``auth`` (bearer token), ``limits`` (body ceiling), ``serving`` (the server on the running loop),
``client``/``transport`` (the store API over HTTP). ``legacy``: 0.1's ``AgentLightningServer``,
which ``agentlightning.server`` held.

The HTTP modules load on first use (FastAPI and uvicorn are not imported by ``import eventlight``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventlight.server.legacy import AgentLightningServer

if TYPE_CHECKING:
    from eventlight.server.client import LightningStoreClient
    from eventlight.server.serving import LightningStoreServer

__all__ = ["AgentLightningServer", "LightningStoreClient", "LightningStoreServer"]


def __getattr__(name: str) -> object:
    if name == "LightningStoreServer":
        from eventlight.server.serving import LightningStoreServer

        return LightningStoreServer
    if name == "LightningStoreClient":
        from eventlight.server.client import LightningStoreClient

        return LightningStoreClient
    raise AttributeError(f"module 'eventlight.server' has no attribute {name!r}")
