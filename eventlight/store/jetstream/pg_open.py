"""Opening Postgres while it takes no connection now: ``open_waiting``.

A server at ``max_connections`` (or a role or database at its ``CONNECTION LIMIT``) answers a new
connection with "too many clients"; one starting up or shutting down with "the database system is
starting up". Both pass (``pg_errors.BUSY``), so opening a store, or applying migrations, tries
again for a while, as the projector retries its batches (``RETRY_S`` doubling to ``RETRY_MAX_S``),
instead of failing at once. Anything else (nothing listens, a bad password, no such database) fails
at once, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import redact
from eventlight.store.jetstream.pg_errors import BUSY

__all__ = ["RETRY_MAX_S", "RETRY_S", "open_waiting"]

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_S = 0.5
"""Seconds before the second try; each next pause is twice the one before, up to ``RETRY_MAX_S``."""
RETRY_MAX_S = 5.0


async def open_waiting(
    server: str,
    what: str,
    open_: Callable[[], Awaitable[T]],
    *,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``await open_()``, tried again while Postgres answers that it takes no connection now.

    ``open_`` raises ``ServiceUnavailableError`` (``pg_errors.pg_errors``) for a server failure; one
    whose cause is ``BUSY`` ("too many clients", starting up) is tried again after ``RETRY_S``
    seconds, then at doubling intervals up to ``RETRY_MAX_S``, with one warning line a try, until
    ``wait_s`` seconds have passed since the first try.

    Args:
        server: The DSN (redacted here) named in the warnings and the error.
        what: What ``open_`` does, for the lines (``"opening the store"``, ``"applying migrations"``).
        open_: Makes one try; called again for each.
        wait_s: Seconds to keep trying (``Settings.pg_open_wait_s``); 0: one try.
        clock: Monotonic seconds (injectable for tests).

    Returns:
        What ``open_`` returned.

    Raises:
        ServiceUnavailableError: ``open_`` failed otherwise (at once), or Postgres still took no
            connection after ``wait_s`` seconds: one line naming the server (no password) and the
            cause, with the cause chained.
    """
    shown = redact(server)
    deadline = clock() + wait_s
    delay = RETRY_S
    tries = 0
    while True:
        tries += 1
        try:
            return await open_()
        except ServiceUnavailableError as e:
            cause = e.__cause__
            if not isinstance(cause, BUSY):
                raise
            left = deadline - clock()
            if left <= 0:
                raise ServiceUnavailableError(
                    shown,
                    f"Postgres: {what} gave up after {wait_s:g} s ({tries} tries, EVENTLIGHT_PG_OPEN_WAIT_S): "
                    f"{_one_line(cause)}",
                ) from cause
            pause = min(delay, left)
            log.warning(
                "Postgres at %s takes no connection now (%s); %s: trying again in %.1f s (up to %g s in all)",
                shown,
                _one_line(cause),
                what,
                pause,
                wait_s,
            )
            await asyncio.sleep(pause)
            delay = min(delay * 2, RETRY_MAX_S)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
