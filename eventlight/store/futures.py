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


async def wait_done(
    work: asyncio.Future[Any], timeout: float | None = None, *, wake: set[asyncio.Future[None]] | None = None
) -> bool:
    """Wait until ``work`` is done or ``timeout`` seconds (``None``: no limit) have passed, without
    cancelling it; whether it is done. ``asyncio.wait([work], timeout=)`` for one future at about a
    third of its CPU (no sets, no callbacks on a copy), on the path of every dequeue.

    With ``wake``, the wait's own future is in that set while it waits: whoever sets a result on it
    (a store beginning to close) ends the wait early.

    Raises:
        asyncio.CancelledError: The caller was cancelled (``work`` goes on).
    """
    if work.done():
        return True
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake_up(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    work.add_done_callback(wake_up)
    timer = loop.call_later(timeout, wake_up) if timeout is not None else None
    if wake is not None:
        wake.add(waiter)
    try:
        await waiter
    finally:
        work.remove_done_callback(wake_up)
        if timer is not None:
            timer.cancel()
        if wake is not None:
            wake.discard(waiter)
    return work.done()
