"""Limits on request bodies, checked before any route sees one.

An ASGI middleware that reads the body and hands it on whole, refusing:

* a body over ``max_body_bytes`` (413): a ``Content-Length`` above it at once, a chunked body as
  soon as it passes it;
* a body that would take the bytes held by all requests at once past ``max_buffered_bytes`` (503
  with ``Retry-After``): a body counts the bytes that came, as they come, until the app has answered
  it (or released it, ``release_body``: then what the route still holds is not capped), so N
  clients each sending a body just under the limit cannot make the server hold N times the limit
  while they send it (a declared ``Content-Length`` is not counted ahead: clients that declare large bodies and
  send them a byte at a time would hold the whole cap while holding nothing);
* a body whose next bytes do not come within ``body_timeout_s`` (408, and the connection closed):
  uvicorn has no such timeout, so a client that sent its headers and then stalled held its
  request (and the bytes it had sent) for ever;
* a body that falls ``body_timeout_s`` behind ``body_min_bytes_per_s`` (408, the connection closed):
  a client sending a byte every ``body_timeout_s`` less a little (slowloris) never tripped the idle
  timeout and held its request, and its share of ``max_buffered_bytes``, for ever. Its deadline is
  now also ``body_timeout_s`` after the time its bytes so far would take at the minimum rate, so a
  body of ``n`` bytes is read within ``body_timeout_s + n / body_min_bytes_per_s`` at most (Apache
  httpd's ``mod_reqtimeout`` ``body=…,MinRate=…`` bound; neither uvicorn nor h11 has a body
  deadline or a minimum rate, only ``timeout_keep_alive`` between requests);
* any request once the server stops (503): see ``BodyReads.stop`` and ``BodyReads.cut``.

A route that holds more than its body while it answers (OTLP's inflated copy of a gzip body) counts
those bytes against the same ``max_buffered_bytes`` with ``BodyReads.holding``; one that has done
with its body before it answers (the LLM proxy, once it parsed the call and waits for the model)
stops its bytes counting with ``release_body``.

``eventlight serve`` and the LLM proxy both use it; each says how its answers look (``refuse``).
(Starlette's own ``RequestBodyLimitMiddleware`` answers a ``Content-Length`` over its limit with a
plain-text 413 whatever the application sends, which no OpenAI client can read.)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Literal

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eventlight.server.errors import error_response

__all__ = [
    "DEFAULT_BODY_MIN_BYTES_PER_S",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "REFUSAL_STATUS",
    "RETRY_AFTER_S",
    "BodyLimit",
    "BodyReads",
    "RefusalReason",
    "max_buffered_bytes_for",
    "release_body",
]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a large OTLP batch fits (collectors send a few MiB at most by default)."""

DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024 * 1024
"""256 MiB: the least default of ``max_buffered_bytes`` (``max_buffered_bytes_for``). Request
bodies are a few KiB to a few MiB (chat calls, OTLP batches of tens of spans), so thousands fit at
once; it only binds when many clients send bodies near the per-body limit together, and it keeps
what they make the process hold within a budget that fits beside a trainer on any machine."""

DEFAULT_BODY_TIMEOUT_S = 30.0
"""Seconds a request body may go without a byte arriving (408 after): a client on a working network
sends its body in well under a second; 30 s leaves room for a slow link or a paused process."""

DEFAULT_BODY_MIN_BYTES_PER_S = 1024.0
"""1 KiB/s (8 kbit/s), the least average rate a body may come at once ``body_timeout_s`` of slack is
spent: below any link a client may send from (GPRS sends 20-40 kbit/s; Apache httpd's
``mod_reqtimeout`` asks 500 bytes/s by default), so it never bites a working client, while a
slowloris client (a byte every ``body_timeout_s`` less a little) is cut after about
``body_timeout_s``. A body of ``n`` bytes is read within ``body_timeout_s + n / 1024`` s at most: a
64 KiB chat call within 94 s, a body at the 16 MiB limit within 4.6 h (a client that sends most of
a large body fast earns that much time; it has to send the bytes to hold them)."""

RefusalReason = Literal["too_large", "busy", "timeout", "too_slow", "stopping"]
"""Why ``BodyLimit`` refuses a request: over ``max_body_bytes``, over ``max_buffered_bytes``, no
byte within ``body_timeout_s``, ``body_timeout_s`` behind ``body_min_bytes_per_s``, the server stops."""

REFUSAL_STATUS: dict[RefusalReason, int] = {
    "too_large": 413,
    "busy": 503,
    "timeout": 408,
    "too_slow": 408,
    "stopping": 503,
}
"""The HTTP status of each ``RefusalReason``."""

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 for bodies held: one body answered frees its bytes (the OpenAI SDK waits this long)."""


def max_buffered_bytes_for(max_body_bytes: int) -> int:
    """The default ``max_buffered_bytes``: 256 MiB, or 4 bodies of ``max_body_bytes`` when larger
    (a few bodies at the limit are always taken at once)."""
    return max(DEFAULT_MAX_BUFFERED_BYTES, 4 * max_body_bytes)


_STORE_ERROR_TYPES: dict[RefusalReason, str] = {
    "too_large": "PayloadTooLarge",
    "busy": "ServiceUnavailableError",
    "timeout": "RequestTimeout",
    "too_slow": "RequestTimeout",
    "stopping": "ServiceUnavailableError",
}


def _store_refusal(reason: RefusalReason, detail: str, scope: Scope) -> Response:
    retryable = reason != "too_large"
    return error_response(REFUSAL_STATUS[reason], detail, _STORE_ERROR_TYPES[reason], retryable=retryable, scope=scope)


class BodyReads:
    """What one server's ``BodyLimit`` shares across its requests: the body bytes held, the reads in
    progress, and whether the server stops. Its owner calls ``stop`` / ``cut`` as it shuts down."""

    def __init__(self) -> None:
        self.held_bytes = 0
        """Bytes of request bodies held now: those read so far, until the app has answered."""
        self.stopping = False
        """Set by ``stop``: every request from then on answers 503 (``"stopping"``)."""
        self.cut_off = False
        """Set by ``cut``: bodies still arriving answer 503 (``"stopping"``)."""
        self._reads: set[asyncio.Timeout] = set()

    @property
    def reading(self) -> int:
        """Requests whose body is still arriving."""
        return len(self._reads)

    def hold(self, extra: int, limit: int) -> bool:
        """Count ``extra`` more bytes held, unless that takes ``held_bytes`` past ``limit`` (then ``False``)."""
        if extra > 0 and self.held_bytes + extra > limit:
            return False
        self.held_bytes += max(extra, 0)
        return True

    @contextlib.contextmanager
    def holding(self, limit: int) -> Iterator[Callable[[int], bool]]:
        """Count bytes a route holds besides its body (an inflated copy of it) in ``held_bytes``
        until the block ends.

        Args:
            limit: The server's ``max_buffered_bytes``.

        Yields:
            ``take(n)``: counts ``n`` more bytes and returns ``True``, or returns ``False`` (counting
            nothing) when they would take ``held_bytes`` past ``limit``; the caller then refuses the
            request (503 with ``Retry-After: RETRY_AFTER_S``).
        """
        taken = 0

        def take(extra: int) -> bool:
            nonlocal taken
            if not self.hold(extra, limit):
                return False
            taken += max(extra, 0)
            return True

        try:
            yield take
        finally:
            self.held_bytes -= taken

    @contextlib.contextmanager
    def reading_under(self, deadline: asyncio.Timeout) -> Iterator[None]:
        """Count a body read in progress, whose ``deadline`` (entered) ``cut`` brings forward to now."""
        self._reads.add(deadline)
        try:
            yield
        finally:
            self._reads.discard(deadline)

    def stop(self) -> None:
        """Answer every request arriving from now on 503 (the server shuts down); reads in progress go on."""
        self.stopping = True

    def cut(self) -> None:
        """``stop``, and answer every request whose body is still arriving 503 now (on the event loop
        serving them), before uvicorn's shutdown cancels it with a traceback."""
        self.stop()
        self.cut_off = True
        for deadline in self._reads:
            if not deadline.expired():  # one whose body timeout fired this turn ends as a 408 (reschedule would raise)
                deadline.reschedule(asyncio.get_running_loop().time())

    def reopen(self) -> None:
        """Take requests again (a server started after ``stop``)."""
        self.stopping = self.cut_off = False


class _Intake:
    """One request's body as it arrives: its chunks, the bytes it counts in ``BodyReads.held_bytes``
    (those that came), when its read began and its last chunk came (the event loop's clock), and
    whether its deadline is the minimum rate's (else the idle timeout's)."""

    def __init__(self, declared: int | None, started: float):
        self.declared = declared
        self.chunks: list[bytes] = []
        self.size = 0
        self.held = 0
        self.started = started
        self.last = started
        self.paced = False


_RELEASE_KEY = "eventlight.release_body"
"""The ASGI scope key under which ``BodyLimit`` leaves a request's ``release_body`` callback."""


def release_body(scope: Scope) -> None:
    """Stop counting this request's body in ``max_buffered_bytes``: the route holds no copy of its
    bytes any more (it parsed them) and answers later (it waits for a model). A no-op outside
    ``BodyLimit`` or when called again.

    Args:
        scope: The request's ASGI scope (``request.scope``), as ``BodyLimit`` handed it on.
    """
    release = scope.get(_RELEASE_KEY)
    if release is not None:
        release()


class BodyLimit:
    """Refuse request bodies that are too large, too many at once, or too slow (an ASGI middleware).

    Args:
        app: The application to guard.
        max_body_bytes: The largest body taken, in bytes (413 above).
        max_buffered_bytes: The most body bytes held by all requests at once (503 with
            ``Retry-After: 1`` for a body that would pass it); default ``max_buffered_bytes_for``.
        body_timeout_s: Seconds a body may go without a byte arriving (408, the connection closed);
            ``None``: no timeout, and no minimum rate either.
        body_min_bytes_per_s: The least average rate of a body, in bytes per second, with
            ``body_timeout_s`` of slack: a body whose bytes so far would have come at this rate more
            than ``body_timeout_s`` ago is answered 408 and its connection closed (a body of ``n``
            bytes is read within ``body_timeout_s + n / body_min_bytes_per_s`` s); ``None``: none
            (then a client sending a byte every ``body_timeout_s`` holds its request for ever).
            Default ``DEFAULT_BODY_MIN_BYTES_PER_S`` (1 KiB/s).
        refuse: Builds the answer from its reason, its one-line message and the request's scope;
            it must use ``REFUSAL_STATUS[reason]``. Default: the store server's error answer
            (``ErrorBody``, or OTLP's ``Status`` on ``/v1/traces``; the LLM proxy answers OpenAI's
            error object).
        reads: The state shared across requests, for the owner to ``stop`` / ``cut`` and to read;
            default: a new one.

    A body counts its bytes until the app has answered, or until the route calls ``release_body``.

    Raises:
        ValueError: ``max_body_bytes`` is not positive, ``max_buffered_bytes`` is below it (no body
            at the limit could be taken), or ``body_timeout_s`` / ``body_min_bytes_per_s`` is not a
            positive number.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        *,
        max_buffered_bytes: int | None = None,
        body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
        body_min_bytes_per_s: float | None = DEFAULT_BODY_MIN_BYTES_PER_S,
        refuse: Callable[[RefusalReason, str, Scope], Response] = _store_refusal,
        reads: BodyReads | None = None,
    ):
        check_body_limits(max_body_bytes, max_buffered_bytes, body_timeout_s, body_min_bytes_per_s)
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max_buffered_bytes or max_buffered_bytes_for(max_body_bytes)
        self.body_timeout_s = body_timeout_s
        self.body_min_bytes_per_s = body_min_bytes_per_s
        self.reads = reads if reads is not None else BodyReads()
        self._refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.reads.stopping:
            await self._answer("stopping", "the server is stopping and takes no new requests", scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"content-length")
        length = int(header) if header is not None and header.isdigit() else None
        if length is not None and length > self.max_body_bytes:
            message = f"request body of {length} bytes is over the server's limit of {self.max_body_bytes} bytes"
            await self._answer("too_large", message, scope, receive, send)
            return
        intake = _Intake(length, asyncio.get_running_loop().time())

        def release() -> None:
            self.reads.held_bytes -= intake.held
            intake.held = 0

        try:
            outcome = await self._read(receive, intake)
            if outcome is None:  # the client went away
                return
            if isinstance(outcome, tuple):
                intake.chunks.clear()
                await self._answer(*outcome, scope, receive, send)
                return
            scope[_RELEASE_KEY] = release
            await self._serve(intake.chunks, scope, receive, send)
        finally:
            release()

    async def _read(self, receive: Receive, intake: _Intake) -> Literal["whole"] | tuple[RefusalReason, str] | None:
        """Gather the body into ``intake``: ``"whole"``, the refusal to answer, or ``None`` (the client left)."""
        try:
            async with asyncio.timeout_at(self._deadline(intake)) as deadline:  # a time of the loop's clock
                with self.reads.reading_under(deadline):
                    return await self._gather(receive, deadline, intake)
        except TimeoutError:
            return self._stalled(intake)

    async def _gather(
        self, receive: Receive, deadline: asyncio.Timeout, intake: _Intake
    ) -> Literal["whole"] | tuple[RefusalReason, str] | None:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            intake.size += len(chunk)
            if intake.size > self.max_body_bytes:
                return "too_large", (
                    f"request body of more than {self.max_body_bytes} bytes (sent in chunks) is over the"
                    f" server's limit of {self.max_body_bytes} bytes"
                )
            if intake.size > intake.held:
                if not self.reads.hold(intake.size - intake.held, self.max_buffered_bytes):
                    return "busy", self._busy(intake.size)
                intake.held = intake.size
            intake.chunks.append(chunk)
            if not message.get("more_body", False):
                return "whole"
            intake.last = asyncio.get_running_loop().time()
            deadline.reschedule(self._deadline(intake))

    def _deadline(self, intake: _Intake) -> float | None:
        """The earlier of ``body_timeout_s`` after the last chunk and ``body_timeout_s`` after the time
        the bytes read so far take at ``body_min_bytes_per_s`` (``intake.paced`` when that one)."""
        if self.reads.cut_off:  # a chunk that came as the server cut the reads must not put the cut off
            return asyncio.get_running_loop().time()
        if self.body_timeout_s is None:
            return None
        idle = intake.last + self.body_timeout_s
        if self.body_min_bytes_per_s is None:
            return idle
        paced = intake.started + intake.size / self.body_min_bytes_per_s + self.body_timeout_s
        intake.paced = paced < idle
        return min(idle, paced)

    def _busy(self, size: int) -> str:
        return (
            f"request bodies in progress hold {self.reads.held_bytes} bytes; this one ({size} bytes) would pass"
            f" the server's limit of {self.max_buffered_bytes} bytes held at once: retry shortly"
        )

    def _stalled(self, intake: _Intake) -> tuple[RefusalReason, str]:
        read = f"{intake.size} of {intake.declared}" if intake.declared is not None else f"{intake.size}"
        if self.reads.cut_off:
            return "stopping", f"the server stopped while the request body was still arriving ({read} bytes read)"
        if intake.paced:
            took_s = asyncio.get_running_loop().time() - intake.started
            return "too_slow", (
                f"the request body came slower than {self.body_min_bytes_per_s:g} bytes/s ({read} bytes read in"
                f" {took_s:.1f} s, {self.body_timeout_s:g} s behind that rate): the server's minimum body rate"
            )
        return "timeout", (
            f"no byte of the request body came for {self.body_timeout_s:g} s ({read} bytes read): the"
            " server's body timeout"
        )

    async def _answer(self, reason: RefusalReason, message: str, scope: Scope, receive: Receive, send: Send) -> None:
        response = self._refuse(reason, message, scope)
        if reason == "busy":
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        elif REFUSAL_STATUS[reason] == 408:  # the client fell behind mid-body: the connection can carry no more
            response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def _serve(self, chunks: list[bytes], scope: Scope, receive: Receive, send: Send) -> None:
        # Handed on once and not kept: the app's copy is then the only one (``release_body`` counts on it).
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        chunks.clear()  # else the body is held twice while the app runs (each request allowed near the limit)

        async def replay() -> Message:
            if pending:
                return pending.pop()
            return await receive()

        await self.app(scope, replay, send)


def check_body_limits(
    max_body_bytes: int,
    max_buffered_bytes: int | None,
    body_timeout_s: float | None,
    body_min_bytes_per_s: float | None,
) -> None:
    """Check the limits ``BodyLimit`` takes (its ``Raises:``), with messages naming each.

    Raises:
        ValueError: One is not a positive number, or ``max_buffered_bytes < max_body_bytes``.
    """
    for name, value in (("max_body_bytes", max_body_bytes), ("max_buffered_bytes", max_buffered_bytes)):
        if value is None and name == "max_buffered_bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of bytes >= 1, got {value!r}")
    if max_buffered_bytes is not None and max_buffered_bytes < max_body_bytes:
        raise ValueError(
            f"max_buffered_bytes ({max_buffered_bytes}) must be at least max_body_bytes ({max_body_bytes}):"
            " else no body at the limit could be taken"
        )
    for name, number, unit in (
        ("body_timeout_s", body_timeout_s, "a number of seconds"),
        ("body_min_bytes_per_s", body_min_bytes_per_s, "a number of bytes per second"),
    ):
        if number is not None and (
            isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0
        ):
            raise ValueError(f"{name} must be {unit} > 0 (or None), got {number!r}")
