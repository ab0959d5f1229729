"""``ProjectorGroup``: this process's share of a partitioned namespace's projection.

One ``Projector`` per partition runs in the process; each competes for its partition's advisory
lock (``partition.lock_key``) only while the process holds fewer partitions than its fair share.
The share is the partition count split over the live projector processes of the namespace, which
each hold one shared advisory lock (``partition.member_key``) on a connection of their own, so
``pg_locks`` lists them and a process that dies leaves the list when Postgres sees its connection
end (and its partitions' locks with it). Every ``SHARE_REFRESH_S`` the process reads the list:

* a process that appears makes the others' share smaller: a projector whose partition is beyond
  its process's share steps down (``Deposed``, the highest-numbered partitions first) and a
  process with fewer takes the partition over from its checkpoint;
* a process that dies makes the others' share larger: they take its partitions over.

A partition changes hands only through its lock and its term (``leader``), so nothing is applied
twice or skipped, whatever the timing of these reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg

from eventlight.core.events import AnyEvent
from eventlight.core.types import now as wall_clock
from eventlight.store.futures import cancels, raise_if_cancelled
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.projector.common import _spawn
from eventlight.store.jetstream.projector.leader import Projector
from eventlight.store.jetstream.projector.partition import fair_share, member_key, members, record_partitions

log = logging.getLogger(__name__)

SHARE_REFRESH_S = 0.5
"""Seconds between reads of the live projector processes (``pg_locks``)."""


class _AllLead:
    """``leader.is_set()``: this process leads every partition (its commits then say how far the
    projection is, as a one-partition projector's do)."""

    def __init__(self, projectors: list[Projector]):
        self._projectors = projectors

    def is_set(self) -> bool:
        return all(p.leader.is_set() for p in self._projectors)


class ProjectorGroup:
    """Projects this process's fair share of the partitions of one namespace.

    Args:
        log_: The event log (NATS side).
        pool: A pool on the namespace's schema; it needs ``2 * partitions + 1`` connections more
            than the store's own use (a lock connection and a batch's per partition, one to list
            the live processes).
        partitions: The namespace's partition count (``Settings.projector_partitions``, > 1).
        watchdog_interval_s, on_commit, on_leadership, clock: As for ``Projector`` (each partition's watchdog
            watches that partition's rollouts).
    """

    def __init__(
        self,
        log_: JetStreamEventLog,
        pool: asyncpg.Pool,
        partitions: int,
        *,
        watchdog_interval_s: float = 1.0,
        on_commit: Callable[[int, set[str]], None] | None = None,
        on_leadership: Callable[[], None] | None = None,
        clock: Callable[[], float] = wall_clock,
    ):
        self.pool = pool
        self.schema = log_.settings.pg_schema
        self.partitions = partitions
        self.projectors = [
            Projector(
                log_,
                pool,
                watchdog_interval_s=watchdog_interval_s,
                on_commit=on_commit,
                on_leadership=on_leadership,
                clock=clock,
                partition=p,
                partitions=partitions,
                share=self,
            )
            for p in range(partitions)
        ]
        self.leader = _AllLead(self.projectors)
        self.members: list[int] = []
        self.me = 0
        self._claimed: set[int] = set()
        self._member_conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None

    # -- the fair share (``leader.Share``) ------------------------------------------------------

    def target(self) -> int:
        """How many partitions this process should lead now (0 until the processes are known)."""
        return fair_share(self.partitions, self.members, self.me) if self.me else 0

    def claim(self, partition: int) -> bool:
        if partition not in self._claimed and len(self._claimed) >= self.target():
            return False
        self._claimed.add(partition)
        return True

    def release(self, partition: int) -> None:
        self._claimed.discard(partition)

    def surplus(self, partition: int) -> bool:
        extra = len(self._claimed) - self.target()
        return extra > 0 and partition in sorted(self._claimed, reverse=True)[:extra]

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Record (or check) the partition count, join the live processes and start every
        partition's projector; returns once each has had its first try for its lock.

        Raises:
            InvalidInputError: The namespace is recorded with another partition count.
        """
        async with self.pool.acquire() as conn:
            await record_partitions(conn, self.partitions)
        await self._join()
        self._task = _spawn(self._keep_share(), "eventlight-projector-share")
        await asyncio.gather(*(p.start() for p in self.projectors))

    async def close(self) -> None:
        """Stop every partition's projector and leave the live processes; bounded in time."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await asyncio.gather(*(p.close() for p in self.projectors))
        await self._leave()

    async def _join(self) -> None:
        conn = await self.pool.acquire()
        try:
            await conn.execute("SELECT pg_advisory_lock_shared($1)", member_key(self.schema))
            self.me = int(await conn.fetchval("SELECT pg_backend_pid()"))
            self.members = await members(conn, self.schema)
        except BaseException:
            await self.pool.release(conn)
            raise
        self._member_conn = conn
        log.info("projector process %d of %s joins %d others", self.me, self.schema, len(self.members) - 1)

    async def _leave(self) -> None:
        conn, self._member_conn = self._member_conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed():
                await asyncio.wait_for(conn.execute("SELECT pg_advisory_unlock_all()"), 2)
            await self.pool.release(conn, timeout=2)
        except Exception as e:  # lost: the lock went with the session
            log.debug("projector group: giving the member connection back: %r", e)
            with contextlib.suppress(Exception):
                conn.terminate()

    async def _keep_share(self) -> None:
        """Read the live processes every ``SHARE_REFRESH_S``; join again if the member connection
        was lost (until then this process counts itself last)."""
        base = cancels()
        while True:
            await asyncio.sleep(SHARE_REFRESH_S)
            raise_if_cancelled(base)  # one a wait_for below swallowed (3.11) on the previous round
            try:
                conn = self._member_conn
                if conn is None or conn.is_closed():
                    await self._leave()
                    await self._join()
                    continue
                found = await asyncio.wait_for(members(conn, self.schema), 2)
                if found != self.members:
                    log.info("projector processes of %s: %s (this one: %d)", self.schema, found, self.me)
                self.members = found
            except Exception as e:  # Postgres failing: the partitions' own locks say who leads
                log.warning("projector group of %s: reading the live processes failed: %r", self.schema, e)

    # -- what the store and its read model read ---------------------------------------------------

    @property
    def checkpoint(self) -> int:
        """The lowest checkpoint of the partitions (the projection's position when all lead here)."""
        return min(p.checkpoint for p in self.projectors)

    @property
    def led(self) -> list[int]:
        """The partitions this process leads now."""
        return [p.partition for p in self.projectors if p.leader.is_set()]

    @property
    def dead_letters(self) -> int:
        return sum(p.dead_letters for p in self.projectors)

    @property
    def terms_led(self) -> int:
        return sum(p.terms_led for p in self.projectors)

    async def tick(self, now: float | None = None) -> list[AnyEvent]:
        """One watchdog tick of every partition this process leads; the events it appended."""
        out: list[AnyEvent] = []
        for p in self.projectors:
            if p.leader.is_set():
                out.extend(await p.watchdog.tick(now))
        return out

    async def watch_once(self, now: float | None = None) -> int:
        """``tick``, counted (as ``Projector.watch_once``)."""
        return len(await self.tick(now))
