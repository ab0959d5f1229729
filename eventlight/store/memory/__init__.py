"""``InMemoryLightningStore``: the one store over an in-memory log and read model.

For tests and quick local work, in one process (``capabilities`` says so). The log is a list of
events (``MemoryEventLog.events``); the read model is their fold by the projector's code
(``eventlight.store.fold``), applied as each event is appended. The watchdog runs when
``run_watchdog(now)`` is called, and every ``watchdog_interval_s`` seconds in a background task on
the running event loop: from ``start()`` (``async with``), or else from the first store call made
inside a running loop, so a store used without ``async with`` (as Agent-lightning 0.3.0's is) still
enforces ``timeout_seconds`` and ``unresponsive_seconds``. A store used from a later loop (a second
``asyncio.run``) starts it again there, and its waits (an idle ``dequeue_rollout``,
``wait_for_rollouts``) wait on that loop (``signal.Signal``); ``close()`` stops the watchdog for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable

from eventlight.core.events import AnyEvent
from eventlight.core.types import now as wall_clock
from eventlight.store.base import LightningStoreCapabilities
from eventlight.store.memory.log import MemoryEventLog
from eventlight.store.memory.readmodel import MemoryReadModel
from eventlight.store.service import EventStore
from eventlight.store.service.plumbing import store_call
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
        self._watchdog_closed = False

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": False, "otlp_traces": False}

    async def start(self) -> InMemoryLightningStore:
        """Start the background watchdog (again, after ``close()``)."""
        self._watchdog_closed = False
        self._ensure_watchdog()
        return self

    async def __aenter__(self) -> InMemoryLightningStore:
        return await self.start()

    def _check_open(self) -> None:
        super()._check_open()
        self._ensure_watchdog()  # every store call passes here: the watchdog starts on first use

    def _ensure_watchdog(self) -> None:
        """Run the watchdog on the running loop unless it already runs there (or ``close()`` stopped it)."""
        if self._watchdog_closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # called outside a loop: the next call from a loop starts it
        task = self._watchdog_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        store = weakref.ref(self)  # the task must not keep a store nobody uses alive
        self._watchdog_task = loop.create_task(self.watchdog.run(lambda: store() is None), name="eventlight-watchdog")

    async def close(self) -> None:
        """Let the calls in flight finish and settle the claims of cancelled callers, as the
        JetStream store does (``EventStore.close``), then stop the watchdog. The data stay readable
        and writable afterwards (the in-memory store never closes its log); calls made while it
        closes are refused; concurrent calls wait for the one close."""
        await super().close()

    async def _close(self) -> None:
        try:
            await self._drain_calls()
            await self._settle_abandoned_claims()
        finally:
            self._draining = False
        self._watchdog_closed = True
        task, self._watchdog_task = self._watchdog_task, None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def sync_all(self, timeout_s: float = 0.0) -> None:
        """Nothing to wait for: reads see every write at once (the JetStream store's ``sync_all``)."""

    @store_call
    async def run_watchdog(self, now: float | None = None) -> list[AnyEvent]:
        """One watchdog tick at ``now`` (default: the clock); the ``timeout``/``unresponsive`` events it wrote."""
        return await self.watchdog.tick(now)
