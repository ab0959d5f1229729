"""Small helpers for futures that the store hands out and a cancelled caller may abandon."""

from __future__ import annotations

import asyncio
from typing import Any


def mark_seen(work: asyncio.Future[Any]) -> None:
    """Done callback: mark ``work``'s exception as retrieved, so a future whose waiter was
    cancelled (and will never read it) does not log asyncio's "exception was never retrieved".
    Anyone awaiting ``work`` still gets the exception."""
    if not work.cancelled():
        work.exception()


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was asked to cancel and runs on all the same.

    Python 3.11's ``asyncio.wait_for`` (inside nats-py's ``fetch`` and ``next_msg``) returns the
    inner result instead of raising when a cancel lands as that result arrives: the cancel is lost,
    and a loop around such a call would run on, holding up ``asyncio.run``'s exit for ever. The
    task's ``cancelling()`` count still says a cancel is pending; call this after each such await.

    Raises:
        asyncio.CancelledError: A cancel of the current task is pending.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
