"""nats-py errors mapped to eventlight's, in one place (``raise ... from e``).

* JetStream error 10071 (wrong last sequence: an expected-sequence append was overtaken) becomes
  ``StaleStateError``, which the command loop answers by reloading and deciding again;
* an event over the server's ``max_payload`` or the stream's ``max_msg_size`` (10054) becomes
  ``InvalidInputError``: retrying cannot help;
* any other JetStream API error, a timeout, no responders or a closed connection becomes
  ``ServiceUnavailableError`` naming the server.

``JsNotFoundError`` (nats-py's ``nats.js.errors.NotFoundError``, an API error too) is an answer,
not a failure: callers that expect it catch it inside the ``with`` block. Every other module names
nats-py's errors through this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
NO_LEADER = 503
"""The status of a JetStream API answer while the stream or consumer has no leader (no responders)."""

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


@contextlib.contextmanager
def nats_errors(server: str, what: str) -> Iterator[None]:
    """Map nats-py errors raised inside the block (see the module docstring).

    Args:
        server: The server named in ``ServiceUnavailableError``.
        what: What the block does, for the message (``"publish to el.x.r.ro-1.e"``).

    Raises:
        StaleStateError: A fenced append was overtaken.
        ServiceUnavailableError: Any other NATS failure.
    """
    try:
        yield
    except nats.js.errors.APIError as e:
        if e.err_code == WRONG_LAST_SEQUENCE:
            raise StaleStateError(str(e)) from e
        if e.err_code == MESSAGE_TOO_LARGE:
            raise InvalidInputError(f"{what}: the event is larger than the stream's max_msg_size ({e})") from e
        if e.code == NO_LEADER or isinstance(e, nats.js.errors.ServiceUnavailableError):
            raise ServiceUnavailableError(
                server, f"{what} failed: JetStream has no leader for it now (503: a cluster is electing one)"
            ) from e
        raise ServiceUnavailableError(server, f"{what} failed: {e}") from e
    except nats.errors.MaxPayloadError as e:
        raise InvalidInputError(f"{what}: the event is larger than the NATS server's max_payload ({e!r})") from e
    except TRANSPORT_ERRORS as e:
        raise ServiceUnavailableError(server, f"{what} failed: {e!r}") from e
