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


def cancels() -> int:
    """The current task's cancel requests not yet taken back (``Task.cancelling()``); 0 outside a
    task. Take it before awaiting a call that may swallow a cancel, for ``raise_if_cancelled``."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def raise_if_cancelled(since: int) -> None:
    """Raise ``CancelledError`` if the current task was asked to cancel after ``cancels()`` gave
    ``since``, and runs on all the same.

    Python 3.11's ``asyncio.wait_for`` (inside nats-py's ``fetch`` and ``next_msg``) returns the
    inner result instead of raising when a cancel lands as that result arrives: the cancel is lost,
    and a loop around such a call would run on, holding up ``asyncio.run``'s exit for ever. Only
    requests made since ``since`` count: a count left over from before (3.11's ``TaskGroup`` does
    not always take back the cancel it sent its parent) is not a new cancel.

    Raises:
        asyncio.CancelledError: A cancel of the current task arrived since ``since`` and was lost.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling() > since:
        raise asyncio.CancelledError
