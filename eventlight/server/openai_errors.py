"""OpenAI's error object: how the LLM proxy and GRPO's policy server answer an error.

``{"error": {"message": str, "type": str, "param": str | None, "code": str | int}}``, as OpenAI's
API sends it (the OpenAI SDK raises it as ``APIStatusError`` with ``.type``, ``.param``, ``.code``).
``code`` is OpenAI's own string where OpenAI has one (``invalid_api_key``,
``context_length_exceeded``), else the HTTP status (as vLLM answers).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["SERVER_STOPPING", "openai_error"]

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
