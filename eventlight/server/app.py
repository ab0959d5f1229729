"""``create_app``: the FastAPI application of ``eventlight serve`` over one store.

Routes: Agent-lightning 0.3.0's ``/v1/agl/...`` (``eventlight.server.routes``), OTLP ``/v1/traces``
(``eventlight.server.otlp``), Prometheus ``/metrics`` (``eventlight.server.metrics``), the dashboard
at ``/dashboard`` (``eventlight.server.dashboard``), the OpenAPI description at ``/openapi.json``
(and ``/docs``). Around them, outermost first: the bearer token (when one is set), the body ceiling.
Errors: ``eventlight.server.errors``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from eventlight.core.errors import InvalidInputError
from eventlight.credentials import check_bearer_token
from eventlight.server import dashboard, metrics, otlp
from eventlight.server.auth import BearerAuth
from eventlight.server.codec import openapi_components
from eventlight.server.errors import install_error_handlers
from eventlight.server.limits import (
    DEFAULT_BODY_MIN_BYTES_PER_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    BodyLimit,
    BodyReads,
    check_body_limits,
    max_buffered_bytes_for,
)
from eventlight.server.openapi import document_errors
from eventlight.server.routes import agl_router
from eventlight.store.base import LightningStore

__all__ = ["create_app"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eventlight")
    except PackageNotFoundError:
        return "0"


def create_app(
    store: LightningStore,
    *,
    identity: dict[str, Any] | None = None,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_buffered_bytes: int | None = None,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
    body_min_bytes_per_s: float | None = DEFAULT_BODY_MIN_BYTES_PER_S,
) -> FastAPI:
    """The ASGI app serving ``store``.

    Args:
        store: What the routes call; its writes are its own (events, on JetStream).
        identity: What ``/v1/agl/health`` names besides ``"status": "ok"`` (instance, namespace, ...).
        token: When set, every request must send ``Authorization: Bearer <token>`` (else 401).
        max_body_bytes: Larger request bodies (and OTLP bodies that inflate past it) get 413.
        max_buffered_bytes: The most request-body bytes held by all requests at once (counted until
            each is answered; an OTLP gzip body's inflated copy too); a request that would pass it
            gets 503 with ``Retry-After: 1`` (``retryable``). Default: 256 MiB, or 4 ×
            ``max_body_bytes`` when larger.
        body_timeout_s: Seconds a request body may go without a byte arriving; then 408 and the
            connection is closed (``None``: no timeout, and no minimum rate).
        body_min_bytes_per_s: The least average rate of a request body, in bytes per second, with
            ``body_timeout_s`` of slack; a body further behind gets 408 and the connection is closed
            (``None``: none; default 1 KiB/s, ``eventlight.server.limits.DEFAULT_BODY_MIN_BYTES_PER_S``).

    ``app.state.body_reads`` is the body limit's ``BodyReads`` (the bytes held, the reads in progress),
    ``app.state.max_buffered_bytes`` its cap.

    Raises:
        ValueError: ``max_body_bytes`` / ``max_buffered_bytes`` / ``body_timeout_s`` /
            ``body_min_bytes_per_s`` out of range
            (``eventlight.server.limits.BodyLimit``).
        InvalidInputError: ``token`` is empty or blank (an unset variable in ``--token "$TOKEN"``
            would otherwise serve the store to anyone; ``None`` is "no token", said explicitly), or
            holds a space or a character outside ASCII (a token file's stray space).
    """
    if token is not None and not token.strip():
        raise InvalidInputError(
            "the server token is empty: pass a token, or none at all (None; on the command line leave"
            " out --token and $EVENTLIGHT_SERVER_TOKEN) to serve without one"
        )
    if token is not None:
        check_bearer_token(token, "the server token")
    # BodyLimit is built at the first request
    check_body_limits(max_body_bytes, max_buffered_bytes, body_timeout_s, body_min_bytes_per_s)
    app = FastAPI(
        title="eventlight store server",
        version=_version(),
        description="Agent-lightning 0.3.0's store routes (/v1/agl) and OTLP/HTTP traces (/v1/traces) "
        "over an event-sourced store.",
    )
    app.state.store = store
    app.state.identity = dict(identity or {"store": type(store).__name__})
    app.state.max_body_bytes = max_body_bytes
    app.state.max_buffered_bytes = max_buffered_bytes or max_buffered_bytes_for(max_body_bytes)
    app.include_router(agl_router())
    app.include_router(otlp.router)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    install_error_handlers(app)
    app.state.body_reads = BodyReads()
    app.add_middleware(
        BodyLimit,
        max_body_bytes=max_body_bytes,
        max_buffered_bytes=app.state.max_buffered_bytes,
        body_timeout_s=body_timeout_s,
        body_min_bytes_per_s=body_min_bytes_per_s,
        reads=app.state.body_reads,
    )
    if token:
        app.add_middleware(BearerAuth, token=token)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = document_errors(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
