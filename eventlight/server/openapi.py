"""The OpenAPI description's error answers: every status a route can give, with its body.

FastAPI documents a route's success and its own 422 (``HTTPValidationError``, which this server never
sends: its handlers answer ``ErrorBody``). ``document_errors`` adds what ``eventlight.server.errors``,
the bearer token and the body ceiling answer, so a client generated from ``/openapi.json`` (and
schemathesis, ``tests/test_server_schema.py``) sees every status code and content type there is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventlight.server.models import ErrorBody
from eventlight.server.otlp_wire import PROTOBUF

__all__ = ["document_errors"]

_ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}
STORE_ERRORS: dict[str, str] = {
    "400": "a malformed argument, or a body that is not JSON",
    "401": "a missing or wrong bearer token (when the server was started with one)",
    "404": "an id the store does not know",
    "409": "the change is refused in the rollout's state, or raced another write (retryable)",
    "413": "the request body is over the server's limit",
    "422": "a value of the wrong type or shape; the message names the field",
    "503": "NATS or Postgres did not answer (retryable)",
}
"""The error statuses of the ``/v1/agl`` routes (``eventlight.server.errors``)."""

OTLP_ERRORS: dict[str, str] = {
    "400": "a body that does not parse as an ExportTraceServiceRequest (google.rpc.Status)",
    "401": "a missing or wrong bearer token (when the server was started with one)",
    "413": "the body, or what it inflates to, is over the server's limit",
    "415": "a content type other than application/x-protobuf or application/json",
    "503": "NATS or Postgres did not answer (retryable)",
}
"""The error statuses of ``POST /v1/traces`` (OTLP/HTTP: a ``Status`` in the request's encoding)."""

_OTLP_BODY = {
    PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
    "application/json": {"schema": {"type": "object"}},
}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the error answers above to every operation of ``schema`` (an OpenAPI 3 dict, in place).

    Returns:
        ``schema``, with ``components/schemas/ErrorBody`` and FastAPI's unused validation schemas removed.
    """
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, error_body = msgspec.json.schema_components([ErrorBody], ref_template="#/components/schemas/{name}")
    components.update(error_body)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if path == "/v1/traces":
                responses["200"]["content"] = _OTLP_BODY
                for status, why in OTLP_ERRORS.items():
                    responses[status] = {"description": why, "content": _OTLP_BODY}
                continue
            for status, why in STORE_ERRORS.items():
                responses[status] = {"description": why, "content": {"application/json": {"schema": _ERROR_BODY}}}
    return schema
