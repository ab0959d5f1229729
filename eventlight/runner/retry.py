"""Retrying failed store calls: ``Backoff``, and which errors are worth a retry."""

from __future__ import annotations

import nats.errors

from eventlight.core.errors import EventlightError


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
