"""Bearer-token access: with a token configured, every request must carry ``Authorization: Bearer <token>``.

An ASGI middleware, so it guards every route, the OTLP one and the OpenAPI description included.
``eventlight serve`` and the LLM proxy both use it; each says how its 401 body looks (the server's
``ErrorBody``, or to OTLP's ``/v1/traces`` a ``google.rpc.Status``; the proxy's OpenAI error
object). A request without the header, or with another token, gets 401 with ``WWW-Authenticate:
Bearer`` (RFC 6750) and a one-line message; the token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from eventlight.server.errors import error_response

__all__ = ["BearerAuth", "Refusal"]

Refusal = Callable[[str, Scope], Response]
"""Builds the 401 response from its one-line message and the refused request's scope."""


def _store_refusal(detail: str, scope: Scope) -> Response:
    return error_response(401, detail, "Unauthorized", scope=scope)


class BearerAuth:
    """Refuse HTTP requests that do not carry ``token`` (an ASGI middleware around ``app``).

    Args:
        app: The application to guard.
        token: The token every request must send (``Authorization: Bearer <token>``).
        refuse: Builds the 401 response from its message and the request's scope; default: the store
            server's (``error_response``).
        hint: How to say what was configured, in the message of a request without a token.
        key_header: Also accept the bare token in this header (the LLM proxy: ``x-api-key``, which
            Anthropic's clients send their ``api_key`` in).

    Raises:
        ValueError: ``token`` is empty.
    """

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        *,
        refuse: Refusal = _store_refusal,
        hint: str = "the server was started with --token",
        key_header: str | None = None,
    ):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._refuse = refuse
        self._hint = hint
        self._key_header = key_header.lower().encode() if key_header else None
        self._key = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        # the scheme is case-insensitive (RFC 7235): "bearer x" is "Bearer x"
        bearer = b"Bearer " + auth[7:] if auth is not None and auth[:7].lower() == b"bearer " else None
        key = headers.get(self._key_header) if self._key_header else None
        if (bearer is not None and hmac.compare_digest(bearer, self._expected)) or (
            key is not None and hmac.compare_digest(key, self._key)
        ):
            await self.app(scope, receive, send)
            return
        if auth is None and key is None:
            detail = f"missing bearer token: send 'Authorization: Bearer <token>' ({self._hint})"
        elif auth is not None and bearer is None:
            detail = "the Authorization header must be 'Bearer <token>'"
        else:
            detail = "wrong bearer token"
        response = self._refuse(detail, scope)
        response.headers["WWW-Authenticate"] = 'Bearer realm="eventlight"'
        await response(scope, receive, send)
