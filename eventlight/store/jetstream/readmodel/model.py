"""``SqlReadModel``: the Postgres read model of one namespace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS

from eventlight.store.jetstream.connect import connected_server
from eventlight.store.jetstream.nats_errors import nats_errors
from eventlight.store.jetstream.projector import Projector, ProjectorGroup
from eventlight.store.jetstream.readmodel.waits import SYNC_TIMEOUT_S, Broadcast, Waits, _Waiter

log = logging.getLogger(__name__)

CATCH_UP_STEP_S = 0.25
"""After a re-subscription, how long each read of the checkpoint waits at most before asking again
whether this process leads once more."""

RESUBSCRIBE_FIRST_S = 0.5
RESUBSCRIBE_MAX_S = 5.0
"""A re-subscription to terminal events that failed is tried again after ``RESUBSCRIBE_FIRST_S``,
the delay doubling up to ``RESUBSCRIBE_MAX_S`` seconds, until it succeeds, this process leads again
or the read model closes."""


class SqlReadModel(Waits):
    """Queries over one namespace's Postgres schema.

    ``wait_for_rollouts`` is woken by this process's projector while it leads, and otherwise by the
    terminal events on the stream; so the read model subscribes to them only while the local
    projector does not lead (``_on_leadership``): a leading process receives none of them.

    Args:
        pool: Connections that use the namespace's schema.
        nc: The NATS connection (``wait_for_rollouts`` follows terminal events on the stream).
        prefix: The namespace's subject prefix (``el.<ns>``).
        projector: This process's projector, if it runs one (its commits wake waiters).
        server: The Postgres DSN, named (without its password) when the server fails.
        head_seq: The stream's last sequence now (``JetStreamEventLog.head_seq``): after the local
            projector loses the lead, waiters read the rollouts again once the projection reaches
            it, for the terminal events published before the subscription was back. ``None``:
            they fall back to reading every 2 s.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        nc: NATS,
        prefix: str,
        projector: Projector | ProjectorGroup | None,
        server: str = "postgres",
        head_seq: Callable[[], Awaitable[int]] | None = None,
    ):
        self.pool = pool
        self.server = server
        self.nc = nc
        self.prefix = prefix
        self.projector = projector
        self._head_seq = head_seq
        self._changed = Broadcast()
        self._hints: set[str] = set()
        self._waiters: list[_Waiter] = []
        self._watch_sub: Any = None
        self._following = asyncio.Lock()  # one change of the subscription at a time
        self._followers: set[asyncio.Task[None]] = set()
        self._closed = False
        self._resubscribe_failing = False  # warned of a failed re-subscription; quiet until one succeeds
        self._alone: asyncio.Task[str | None] | None = None  # the probe on a connection of its own

    async def start(self) -> None:
        """Follow terminal events (only ever published on a rollout's ``e`` subject: ``enters_queue``)
        while no projector of this process leads (none does yet).

        Raises:
            ServiceUnavailableError: NATS did not take the subscription.
        """
        await self._subscribe()

    async def close(self) -> None:
        """Stop following the stream; idempotent (the store closes the pool)."""
        self._closed = True
        for task in list(self._followers):
            task.cancel()
        if self._followers:
            await asyncio.wait(self._followers, timeout=5)
        await self._unsubscribe()

    async def _subscribe(self) -> None:
        """Subscribe to terminal events, and flush: events published after this returns are delivered."""
        with nats_errors(connected_server(self.nc), "subscribing to terminal events"):
            self._watch_sub = await self.nc.subscribe(f"{self.prefix}.r.*.e", cb=self._on_rollout_event)
            await self.nc.flush()

    async def _unsubscribe(self) -> None:
        sub, self._watch_sub = self._watch_sub, None
        self._hints.clear()
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _leads(self) -> bool:
        return self.projector is not None and self.projector.leader.is_set()

    def _on_leadership(self) -> None:
        """The projector's ``on_leadership``: this process started or stopped leading (a partition)."""
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._follow())
        self._followers.add(task)
        task.add_done_callback(self._followers.discard)

    def _wake_all(self) -> None:
        """Every waiter reads Postgres again (whatever way it waits now)."""
        for waiter in self._waiters:
            waiter.dirty = True
        self._changed.notify_all()

    async def _follow(self) -> None:
        """Subscribe to terminal events while this process does not lead, unsubscribe while it does.

        No wake-up is missed across a change. Taking the lead: every waiter reads Postgres once
        (what the previous leader committed), then waits for this projector's commits. Losing it:
        the subscription is back (flushed) before waiters read again; a terminal event published
        before that is at or below the stream's head read after it, so waiters read once more when
        the projection (another process's) reaches that head. A subscription that fails (NATS down)
        is tried again (``RESUBSCRIBE_FIRST_S`` doubling up to ``RESUBSCRIBE_MAX_S``; one warning,
        then quiet until it succeeds) until it succeeds, this process leads again or the read model
        closes; meanwhile waiters read every 2 s.
        """
        delay = RESUBSCRIBE_FIRST_S
        while True:
            head = 0
            try:
                async with self._following:
                    if self._closed:
                        return
                    if self._leads():
                        if self._watch_sub is not None:
                            await self._unsubscribe()
                        self._wake_all()
                        return
                    if self._watch_sub is not None:
                        return
                    await self._subscribe()
                    if self._resubscribe_failing:
                        self._resubscribe_failing = False
                        log.info("read model: following terminal events again")
                    self._wake_all()
                    if self._head_seq is not None:  # also for waiters that start before the projection is there
                        head = await self._head_seq()
            except Exception as e:
                if self._watch_sub is not None:  # subscribed, then the flush or the head failed
                    log.warning("read model: after following terminal events again: %r; waiters read every 2 s", e)
                    return
                if not self._resubscribe_failing:
                    self._resubscribe_failing = True
                    log.warning(
                        "read model: following terminal events after a change of leadership failed: %r; "
                        "trying again (quietly) while waiters read every 2 s",
                        e,
                    )
                else:
                    log.debug("read model: following terminal events failed again: %r; next try in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESUBSCRIBE_MAX_S)
                continue
            break
        if head:
            await self._catch_up(head)

    async def _catch_up(self, head: int) -> None:
        """Wake waiters once the projection reaches stream sequence ``head`` (within
        ``SYNC_TIMEOUT_S``), unless this process leads again first (it wakes them then)."""
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not self._closed and not self._leads() and time.monotonic() < deadline:
            try:
                reached = await self._poll_checkpoint(head, min(deadline, time.monotonic() + CATCH_UP_STEP_S))
            except Exception as e:  # Postgres failing: waiters still read every 2 s
                log.warning("read model: waiting for the projection after a change of leadership: %r", e)
                return
            if reached:
                self._wake_all()
                return
