"""Retrying failed store calls: ``Backoff``, which errors are worth a retry, and ``DequeueOutage``
(one warning for failed dequeues in a row)."""

from __future__ import annotations

import logging

import nats.errors

from eventlight.core.errors import EventlightError, ServiceUnavailableError

log = logging.getLogger(__name__)


class Backoff:
    """Delays between retries of a failing call: ``first_s`` doubling up to ``max_s``.

    Args:
        first_s: The first delay, seconds.
        max_s: The cap, seconds.
    """

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0):
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def next(self) -> float:
        """The delay before the next try; doubles the one after it (capped)."""
        delay = self._next_s
        self._next_s = min(self.max_s, delay * 2)
        return delay

    def reset(self) -> None:
        """Start again from ``first_s`` (after a success)."""
        self._next_s = self.first_s


def _describe(e: BaseException) -> str:
    """One line naming an error: its type and message, and the driver error it was mapped from."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__
    if cause is not None and not isinstance(e, EventlightError):
        text += f" (from {type(cause).__name__})"
    return text


def _retryable(e: BaseException) -> bool:
    """Whether repeating the call may succeed: the tree's ``retryable``, or an unmapped driver,
    network or timeout error."""
    if isinstance(e, EventlightError):
        return e.retryable
    return isinstance(e, (nats.errors.Error, OSError, TimeoutError))


class DequeueOutage:
    """The dequeue failures of one runner in a row (an outage), logged as one warning.

    The first failure worth a retry (``_retryable``: NATS unreachable, a timeout) is a warning, the
    ones after it until a dequeue succeeds are DEBUG lines, and the end of the outage is one INFO
    line. A failure that is no outage (a malformed queue message) is a warning each time; the
    server's notice that it stops in order (``ServiceUnavailableError.shutting_down``: NATS's
    ``409 Server Shutdown`` to the pull in flight) is an INFO line, as the outage it begins gets
    its warning from the failure that follows, if any (and from the connection's own lines).

    Args:
        worker_id: Named in each line (``[Worker-0@host-123-ab12] dequeue failed ...``).
    """

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.warned = False
        self.failures = 0

    def failed(self, e: Exception, delay_s: float) -> None:
        """Log one failed dequeue, retried after ``delay_s`` seconds."""
        self.failures += 1
        if isinstance(e, ServiceUnavailableError) and e.shutting_down:
            level = logging.INFO
        elif not _retryable(e):
            level = logging.WARNING
        elif self.warned:
            level = logging.DEBUG
        else:
            level, self.warned = logging.WARNING, True
        log.log(level, "[%s] dequeue failed, again in %.1f s: %s", self.worker_id, delay_s, _describe(e))

    def over(self) -> None:
        """A dequeue succeeded: the outage, if any, is over."""
        if self.warned:
            log.info("[%s] dequeue works again (after %d failed tries)", self.worker_id, self.failures)
        self.warned, self.failures = False, 0
