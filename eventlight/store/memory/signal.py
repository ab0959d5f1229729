"""``Signal``: an ``asyncio.Event`` that one event loop after another may wait on.

An ``asyncio.Event`` binds to the first loop that waits on it, and a wait from any other loop then
raises ``RuntimeError: ... is bound to a different event loop``. An ``InMemoryLightningStore``
outlives loops (a sync program's ``asyncio.run`` after another, each run of ``Trainer``'s ``"shm"``
on a fresh loop), so its wake-ups are ``Signal``s: a wait from a new loop starts a fresh event
there, set if the old one was. One loop at a time: the store is not thread-safe.
"""

from __future__ import annotations

import asyncio

__all__ = ["Signal"]


class Signal:
    """``set`` / ``clear`` / ``is_set`` / ``wait`` as ``asyncio.Event``'s, from any event loop."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        """Wait until set, on the running loop."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            was_set, self._event, self._loop = self._event.is_set(), asyncio.Event(), loop
            if was_set:
                self._event.set()
        await self._event.wait()
