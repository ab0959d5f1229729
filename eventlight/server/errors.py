"""The error tree mapped to HTTP statuses, in one place: one-line messages, never a traceback.

================================  ======  ==================================================
error                             status  why
================================  ======  ==================================================
``NotFoundError`` (and children)  404     an id the store does not know
``InvalidTransitionError``        409     the decider refused the change
``ConcurrencyError``              409     nothing was written; ``retryable`` (the client retries)
``InvalidTypeError``              422     a value of the wrong type; nothing written
``InvalidInputError``             400     a malformed argument
``ServiceUnavailableError``       503     NATS or Postgres did not answer; ``retryable``
a body that is not JSON           400     the decoder's message, with its position
a body of the wrong shape         422     msgspec's message, naming the field (``$.rollouts[0].mode``)
a query parameter of wrong type   422     FastAPI's validation, folded into one line
another ``ValueError``            400     a check outside the tree
any other exception               500     its type only; logged with its traceback here
================================  ======  ==================================================

Each answer is ``{"detail": ..., "error_type": ..., "retryable": ...}`` (``ErrorBody``); Agent-lightning's
client reads only the status (any 4xx is final, 5xx and 408 are retried). An answer to OTLP's
``/v1/traces`` (these handlers', the bearer token's, the body ceiling's) is instead a
``google.rpc.Status`` in the request's encoding, as OTLP/HTTP asks (``eventlight.server.otlp_wire``).
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Scope

from eventlight.core.errors import (
    ConcurrencyError,
    EventlightError,
    InvalidInputError,
    InvalidTransitionError,
    InvalidTypeError,
    NotFoundError,
    ServiceUnavailableError,
)
from eventlight.server.models import ErrorBody
from eventlight.server.otlp_wire import OTLP_PATH, answer_kind, encode_status

__all__ = ["error_response", "install_error_handlers", "status_of"]

log = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[EventlightError], int], ...] = (
    (NotFoundError, 404),
    (InvalidTransitionError, 409),
    (ConcurrencyError, 409),
    (InvalidTypeError, 422),
    (InvalidInputError, 400),
    (ServiceUnavailableError, 503),
)


def status_of(exc: EventlightError) -> int:
    """The HTTP status of an error of the tree (500 for one the table does not name)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def one_line(text: str) -> str:
    """``text`` on one line (newlines folded), at most 500 characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= 500 else flat[:497] + "..."


def error_response(
    status: int, detail: str, error_type: str, *, retryable: bool = False, scope: Scope | None = None
) -> Response:
    """A JSON ``ErrorBody`` answer; to a request (``scope``) for OTLP's ``/v1/traces``, a
    ``google.rpc.Status`` of ``detail`` in the request's encoding (protobuf or JSON, OTLP/HTTP; for
    a request of no Content-Type, as its Accept header prefers: ``otlp_wire.answer_kind``)."""
    if scope is not None and scope.get("path") == OTLP_PATH:
        headers = Headers(scope=scope)
        kind = answer_kind(headers.get("content-type"), headers.get("accept"))
        return Response(encode_status(kind, status, one_line(detail)), status_code=status, media_type=kind)
    body = ErrorBody(detail=one_line(detail), error_type=error_type, retryable=retryable)
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e.get("loc", ()))
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _on_eventlight(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EventlightError)
    status = status_of(exc)
    if status >= 500:
        log.warning("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(status, str(exc), type(exc).__name__, retryable=exc.retryable, scope=request.scope)


async def _on_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, _validation_detail(exc), "ValidationError", scope=request.scope)


async def _on_decode(request: Request, exc: Exception) -> Response:
    if isinstance(exc, msgspec.ValidationError):
        return error_response(422, f"request body: {exc}", "ValidationError", scope=request.scope)
    return error_response(400, f"request body is not valid JSON: {exc}", "DecodeError", scope=request.scope)


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404 and exc.detail == "Not Found":
        detail = f"no route {request.method} {request.url.path} (the routes: /docs, /openapi.json)"
    elif exc.status_code == 405:
        detail = f"{request.url.path} does not accept {request.method}"
    else:
        detail = str(exc.detail)
    response = error_response(exc.status_code, detail, "HTTPError", scope=request.scope)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _on_value(request: Request, exc: Exception) -> Response:
    """A check outside the tree (e.g. a struct's ``__post_init__``): bad input, 400. Registered on
    its own, not in ``_on_other``: Starlette re-raises what the catch-all handler answered, so the
    server log got a traceback for every such request."""
    return error_response(400, str(exc), type(exc).__name__, scope=request.scope)


async def _on_other(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ValueError):
        return await _on_value(request, exc)
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    detail = f"internal server error ({type(exc).__name__}); the server log has it"
    return error_response(500, detail, "InternalError", scope=request.scope)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(EventlightError, _on_eventlight)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(msgspec.DecodeError, _on_decode)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(ValueError, _on_value)
    app.add_exception_handler(Exception, _on_other)
