"""Bearer-token access: with a token configured, every request must carry ``Authorization: Bearer <token>``.

An ASGI middleware, so it guards every route, the OTLP one and the OpenAPI description included.
A request without the header, or with another token, gets 401 with ``WWW-Authenticate: Bearer``
(RFC 6750) and a one-line ``detail``; the token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from eventlight.server.errors import error_response

__all__ = ["BearerAuth"]


class BearerAuth:
    """Refuse HTTP requests that do not carry ``token`` (an ASGI middleware around ``app``)."""

    def __init__(self, app: ASGIApp, token: str):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        detail = (
            "missing bearer token: send 'Authorization: Bearer <token>' (the server was started with --token)"
            if given is None
            else "wrong bearer token"
        )
        response = error_response(401, detail, "Unauthorized")
        response.headers["WWW-Authenticate"] = 'Bearer realm="eventlight"'
        await response(scope, receive, send)
