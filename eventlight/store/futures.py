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
