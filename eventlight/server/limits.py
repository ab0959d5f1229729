"""A ceiling on request bodies: larger ones get 413 before any route sees them.

An ASGI middleware that reads the body (up to ``max_body_bytes``) and hands it on whole: a
``Content-Length`` above the ceiling is refused at once, a chunked body as soon as it passes it.
``eventlight serve`` and the LLM proxy both use it; each says how its 413 body looks. (Starlette's
own ``RequestBodyLimitMiddleware`` answers a ``Content-Length`` over its limit with a plain-text
413 whatever the application sends, which no OpenAI client can read.)
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eventlight.server.errors import error_response

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimit"]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a large OTLP batch fits (collectors send a few MiB at most by default)."""


def _store_refusal(detail: str, scope: Scope) -> Response:
    return error_response(413, detail, "PayloadTooLarge", scope=scope)


class BodyLimit:
    """Refuse request bodies over ``max_body_bytes`` with 413 (an ASGI middleware around ``app``).

    Args:
        app: The application to guard.
        max_body_bytes: The largest body taken, in bytes.
        refuse: Builds the 413 response from its one-line message and the request's scope; default:
            the store server's error answer (``ErrorBody``, or OTLP's ``Status`` on ``/v1/traces``;
            the LLM proxy answers OpenAI's error object).

    Raises:
        ValueError: ``max_body_bytes`` is not positive.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        *,
        refuse: Callable[[str, Scope], Response] = _store_refusal,
    ):
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._refuse = refuse

    def _too_large(self, size: str, scope: Scope) -> Response:
        return self._refuse(f"request body of {size} is over the server's limit of {self.max_body_bytes} bytes", scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(f"{int(length)} bytes", scope)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                too_large = self._too_large(f"more than {self.max_body_bytes} bytes (sent in chunks)", scope)
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks.clear()  # else the body is held twice while the app runs (each request allowed near the limit)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return whole
            return await receive()

        await self.app(scope, replay, send)
