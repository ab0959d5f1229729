"""OpenAI's error object: how the LLM proxy and GRPO's policy server answer an error.

``{"error": {"message": str, "type": str, "param": str | None, "code": str | int}}``, as OpenAI's
API sends it (the OpenAI SDK raises it as ``APIStatusError`` with ``.type``, ``.param``, ``.code``).
``code`` is OpenAI's own string where OpenAI has one (``invalid_api_key``,
``context_length_exceeded``), else the HTTP status (as vLLM answers).

``body_refusal`` is ``BodyLimit``'s ``refuse`` for these servers: a request body it refuses is
answered in the same object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Scope

from eventlight.server.limits import REFUSAL_STATUS, RefusalReason

__all__ = ["SERVER_STOPPING", "body_refusal", "openai_error"]

SERVER_STOPPING = "server_stopping"
"""The ``type`` of a 503 for a call the server did not take or finish because it stops (the LLM
proxy's and the policy server's)."""


def openai_error(
    status: int, message: str, err_type: str, *, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    """An answer of HTTP ``status`` with OpenAI's error object.

    Args:
        status: The HTTP status.
        message: One line for a person.
        err_type: What went wrong, a stable name (``invalid_request_error``, ``server_stopping``, ...).
        param: The request field at fault, if one is.
        code: OpenAI's code for it; ``None``: ``status``.
    """
    error: dict[str, Any] = {
        "message": message,
        "type": err_type,
        "param": param,
        "code": status if code is None else code,
    }
    return JSONResponse({"error": error}, status_code=status)


_BODY_REFUSALS: dict[RefusalReason, tuple[str, str]] = {
    "too_large": ("invalid_request_error", "max_body_bytes"),
    "busy": ("server_busy", "max_buffered_bytes"),
    "timeout": ("request_timeout", "body_timeout_s"),
    "too_slow": ("request_timeout", "body_min_bytes_per_s"),
    "stopping": (SERVER_STOPPING, ""),
}


def body_refusal(server: str) -> Callable[[RefusalReason, str, Scope], JSONResponse]:
    """``BodyLimit``'s ``refuse`` for the OpenAI-compatible server ``server`` names (``"the LLM proxy"``).

    Each refusal is OpenAI's error object on every route (``scope`` is not read), its message ending
    with the setting at fault (``"... (the LLM proxy's max_body_bytes)"``): 413
    ``invalid_request_error`` over ``max_body_bytes``, 503 ``server_busy`` over
    ``max_buffered_bytes``, 408 ``request_timeout`` past ``body_timeout_s`` or ``body_timeout_s``
    behind ``body_min_bytes_per_s``, 503 ``server_stopping`` while the server stops.
    """

    def refuse(reason: RefusalReason, message: str, scope: Scope) -> JSONResponse:
        err_type, setting = _BODY_REFUSALS[reason]
        said = f"{message} ({server}'s {setting})" if setting else message
        return openai_error(REFUSAL_STATUS[reason], said, err_type)

    return refuse
