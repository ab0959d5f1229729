"""``InMemoryLightningStore``: the one store over an in-memory log and read model.

For tests and quick local work, in one process (``capabilities`` says so). The log is a list of
events (``MemoryEventLog.events``); the read model is their fold by the projector's code
(``eventlight.store.fold``), applied as each event is appended. The watchdog runs when
``run_watchdog(now)`` is called, and every ``watchdog_interval_s`` seconds in a background task
while the store is used inside ``async with`` (``start()``/``close()``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from eventlight.core.events import AnyEvent
from eventlight.core.types import now as wall_clock
from eventlight.store.base import LightningStoreCapabilities
from eventlight.store.memory.log import MemoryEventLog
from eventlight.store.memory.readmodel import MemoryReadModel
from eventlight.store.service import EventStore
from eventlight.store.watchdog import Watchdog

__all__ = ["InMemoryLightningStore", "MemoryEventLog", "MemoryReadModel"]


class InMemoryLightningStore(EventStore):
    """An in-process store.

    Args:
        clock: Returns the current time in seconds; injectable for tests of timing rules.
        watchdog_interval_s: How often the background watchdog checks running attempts.

    Attributes:
        log: The event log (``log.events`` is every event written, in order).
        read_model: The projection of ``log``.
    """

    def __init__(self, *, clock: Callable[[], float] = wall_clock, watchdog_interval_s: float = 1.0):
        self.log = MemoryEventLog(clock)
        self.read_model = MemoryReadModel()
        self.log.subscribe(self.read_model.on_event)
        super().__init__(self.log, self.read_model, clock)
        self.watchdog = Watchdog(self.log, self.read_model.in_flight, clock, watchdog_interval_s)
        self._watchdog_task: asyncio.Task[None] | None = None

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": False, "otlp_traces": False}

    async def start(self) -> InMemoryLightningStore:
        """Start the background watchdog."""
        if self._watchdog_task is None:
            self._watchdog_task = asyncio.create_task(self.watchdog.run(), name="eventlight-watchdog")
        return self

    async def __aenter__(self) -> InMemoryLightningStore:
        return await self.start()

    async def close(self) -> None:
        """Stop the watchdog; the data stay readable (the in-memory store never closes its log)."""
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog_task
            self._watchdog_task = None

    async def sync_all(self, timeout_s: float = 0.0) -> None:
        """Nothing to wait for: reads see every write at once (the JetStream store's ``sync_all``)."""

    async def run_watchdog(self, now: float | None = None) -> list[AnyEvent]:
        """One watchdog tick at ``now`` (default: the clock); the ``timeout``/``unresponsive`` events it wrote."""
        return await self.watchdog.tick(now)
