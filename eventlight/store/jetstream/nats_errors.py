"""nats-py errors mapped to eventlight's, in one place (``raise ... from e``).

* JetStream error 10071 (wrong last sequence: an expected-sequence append was overtaken) becomes
  ``StaleStateError``, which the command loop answers by reloading and deciding again;
* an event over the server's ``max_payload`` or the stream's ``max_msg_size`` (10054), and stream
  replicas asked of a single server (10074), become ``InvalidInputError``: retrying cannot help;
* any other JetStream API error, a timeout, no responders or a closed connection becomes
  ``ServiceUnavailableError`` naming the server.

``JsNotFoundError`` (nats-py's ``nats.js.errors.NotFoundError``, an API error too) is an answer,
not a failure: callers that expect it catch it inside the ``with`` block. Every other module names
nats-py's errors through this one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Literal

import nats.errors
import nats.js.errors

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.store.ports import StaleStateError

__all__ = ["ANY_NATS_ERROR", "NO_MESSAGES", "TRANSPORT_ERRORS", "JsNotFoundError", "nats_errors"]

JsNotFoundError = nats.js.errors.NotFoundError

NO_MESSAGES: tuple[type[BaseException], ...] = (TimeoutError, nats.errors.TimeoutError)
"""What a pull ``fetch`` raises when no message came within its wait: an answer, not a failure."""

ANY_NATS_ERROR: tuple[type[BaseException], ...] = (nats.errors.Error,)
"""Every nats-py error (the root of its tree), for a reader that starts again on any of them."""

WRONG_LAST_SEQUENCE = 10071
MESSAGE_TOO_LARGE = 10054
REPLICAS_NOT_SUPPORTED = 10074
"""JetStream's "replicas > 1 not supported in non-clustered mode"."""
NO_LEADER = 503
"""The status of a JetStream API answer while the stream or consumer has no leader (no responders)."""

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,  # js.publish's no-responders: the stream has no leader now
    nats.errors.ConnectionClosedError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


class nats_errors:  # noqa: N801 - used as a function: ``with nats_errors(server, what):``
    """Map nats-py errors raised inside the block (see the module docstring).

    A plain class, not a ``contextlib.contextmanager`` generator: it wraps every publish and read,
    and entering it must cost nothing when nothing fails (the generator, and formatting the server's
    URL eagerly, were ~20 % of a publish's client CPU).

    Args:
        server: The server named in ``ServiceUnavailableError``, or a callable giving it (called
            only when an error is mapped).
        what: What the block does, for the message (``"publish to el.x.r.ro-1.e"``).

    Raises:
        StaleStateError: A fenced append was overtaken.
        InvalidInputError: The event is larger than the server or stream accepts, or a stream with
            replicas was asked of a single server.
        ServiceUnavailableError: Any other NATS failure.
    """

    __slots__ = ("_server", "_what")

    def __init__(self, server: str | Callable[[], str], what: str):
        self._server = server
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if e is None:
            return False
        what = self._what
        if isinstance(e, nats.js.errors.APIError):
            if e.err_code == WRONG_LAST_SEQUENCE:
                raise StaleStateError(str(e)) from e
            if e.err_code == REPLICAS_NOT_SUPPORTED:
                raise InvalidInputError(
                    f"{what}: the server is a single node and takes no stream replicas (EVENTLIGHT_STREAM_REPLICAS "
                    "or EVENTLIGHT_DURABILITY=replicated need a NATS cluster)"
                ) from e
            if e.err_code == MESSAGE_TOO_LARGE:
                raise InvalidInputError(f"{what}: the event is larger than the stream's max_msg_size ({e})") from e
            if e.code == NO_LEADER or isinstance(e, nats.js.errors.ServiceUnavailableError):
                raise ServiceUnavailableError(
                    self._name(), f"{what} failed: JetStream has no leader for it now (503: a cluster is electing one)"
                ) from e
            raise ServiceUnavailableError(self._name(), f"{what} failed: {e}") from e
        if isinstance(e, nats.errors.MaxPayloadError):
            raise InvalidInputError(f"{what}: the event is larger than the NATS server's max_payload ({e!r})") from e
        if isinstance(e, TRANSPORT_ERRORS):
            if what.startswith(("publish", "atomic batch")) and isinstance(
                e, NO_MESSAGES + (nats.errors.ConnectionClosedError,)
            ):
                # the publish left; its acknowledgement did not come back
                raise ServiceUnavailableError(
                    self._name(), f"{what} failed: {e!r}; the server may have stored it (the outcome is unknown)"
                ) from e
            raise ServiceUnavailableError(self._name(), f"{what} failed: {e!r}") from e
        return False

    def _name(self) -> str:
        server = self._server
        return server if isinstance(server, str) else server()
