"""``Projector``: leadership (the advisory lock and the term), lifecycle, the watchdog and, when
``Settings.retention_s`` is set, the periodic retirement of terminal rollouts to the archive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

import asyncpg

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError
from eventlight.core.types import Worker
from eventlight.core.types import now as wall_clock
from eventlight.store.fold import watched
from eventlight.store.futures import cancels, raise_if_cancelled
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.pg import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    attempt_from_row,
    rollout_from_row,
)
from eventlight.store.jetstream.projector.common import (
    LOCK_PING_S,
    LOCK_PING_TIMEOUT_S,
    NOT_THE_EVENTS,
    READ_ERRORS,
    RETRY_MAX_S,
    RETRY_S,
    START_DECIDE_S,
    Deposed,
    _spawn,
)
from eventlight.store.jetstream.projector.consume import Consumer
from eventlight.store.jetstream.projector.partition import lock_key, partition_of
from eventlight.store.jetstream.projector.workers import WorkerFold
from eventlight.store.watchdog import Watchdog

log = logging.getLogger(__name__)


RETIRE_BATCH = 5000
"""Rollouts one retirement round retires at most (the rest wait for the next round)."""


IN_FLIGHT_SQL = (
    f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE rollout_id = ANY(ARRAY("
    "SELECT rollout_id FROM rollouts WHERE status IN ('preparing', 'running') "
    "UNION SELECT a.rollout_id FROM attempts a WHERE a.status IN ('preparing', 'running')))"
)
"""The rollouts a new leader reads for the watchdog: in flight, or with an attempt still live
(``eventlight.store.fold.watched`` decides among the latter). It costs what is in flight, not the
history: the ids come from ``rollouts_unfinished_idx`` (or ``rollouts_status_idx``) and migration
014's ``attempts_live_idx``, and then the rows are looked up by key (an array of ids, which the
planner cannot turn into a join that reads the whole table).
One ``WHERE status IN (...) OR rollout_id IN (...)`` read every rollout and every attempt instead
(1M attempts: see bench/README.md, "The leader's reload of rollouts in flight")."""


def retire_every_s(retention_s: float) -> float:
    """Seconds between retirement rounds: a quarter of the window, between 1 s and 60 s."""
    return max(1.0, min(60.0, retention_s / 4))


class Share(Protocol):
    """How many partitions this process should lead (``ProjectorGroup``): a partition's projector
    asks before it tries its lock (``claim``; ``release`` when it stops) and, while it leads,
    whether to give its partition up to a process that has fewer (``surplus``)."""

    def claim(self, partition: int) -> bool: ...
    def release(self, partition: int) -> None: ...
    def surplus(self, partition: int) -> bool: ...


class Projector(Consumer):
    """Projects one namespace's stream (or one partition of its rollouts) into Postgres.

    Args:
        log_: The event log (NATS side).
        pool: A pool whose connections use the namespace's schema (or a fresh one, for ``rebuild``).
        watchdog_interval_s: Seconds between watchdog ticks.
        on_commit: Called after each commit with ``(last_seq, ids of the rollouts that are in a
            terminal status after it)``; ``wait_for_rollouts`` re-reads only when one of its ids is there.
        on_leadership: Called (no arguments, on the event loop) each time ``leader`` is set or
            cleared; the read model follows terminal events on the stream only while it is clear.
        clock: Wall-clock seconds, for the watchdog.
        partition: The partition of rollouts this projector projects (``projector.partition``), of
            ``partitions`` (the namespace's recorded count; 1: the whole namespace).
        share: The process's fair share of partitions (``ProjectorGroup``); ``None``: lead whenever
            the lock is free.
    """

    def __init__(
        self,
        log_: JetStreamEventLog,
        pool: asyncpg.Pool,
        *,
        watchdog_interval_s: float = 1.0,
        on_commit: Callable[[int, set[str]], None] | None = None,
        on_leadership: Callable[[], None] | None = None,
        clock: Callable[[], float] = wall_clock,
        partition: int = 0,
        partitions: int = 1,
        share: Share | None = None,
    ):
        self.log = log_
        self.partition = partition
        self.partitions = partitions
        self.share = share
        self.worker_fold = WorkerFold() if partitions > 1 and partition == 0 else None
        self.pool = pool
        self.on_commit = on_commit
        self.on_leadership = on_leadership
        self.checkpoint = 0
        self.term = 0
        self.states: dict[str, RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.workers: dict[str, Worker] = {}
        self.malformed = 0
        self.dead_letters = 0
        self.terms_led = 0
        self.watchdog = Watchdog(log_, self.in_flight, clock, watchdog_interval_s)
        self.clock = clock
        self.retired = 0
        self.leader = asyncio.Event()
        self.last_error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._lock_conn: asyncpg.Connection | None = None
        self._lock_lost = asyncio.Event()
        self._decided = asyncio.Event()  # the first try for the lock is over (leader, standby or failed)
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start competing for leadership; the leader projects and runs the watchdog. Returns once
        the first try for the lock is over (so the first store of a namespace returns as leader)."""
        self._tasks.append(_spawn(self._run(), "eventlight-projector"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._decided.wait(), START_DECIDE_S)

    async def close(self) -> None:
        """Stop the projector and the watchdog and give up leadership; bounded in time."""
        self._stopping = True  # the loops also stop on their own: Python 3.11's wait_for (inside
        # nats-py's fetch) can swallow a cancellation, which left this task running for ever
        tasks, self._tasks = list(self._tasks), []
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5)
            for t in pending:
                log.warning("%s did not stop within 5 s", t.get_name())
        await self._step_down()

    async def _run(self) -> None:
        """Lead, and when leadership ends (lock lost, deposed, a server failure) compete again."""
        failures = 0  # in a row: the wait after the n-th is RETRY_S * 2**(n-1), at most RETRY_MAX_S
        base = cancels()
        while not self._stopping:
            raise_if_cancelled(base)  # one a wait_for swallowed (3.11): stop, as asyncio.run's exit asks
            delay = RETRY_S
            try:
                await self._lead()
                failures = 0
            except Deposed as e:
                log.warning("projector of %s stopped leading (term %d): %s", self.log.settings.namespace, self.term, e)
                self.last_error = e
                failures = 0
            except Exception as e:  # Postgres or NATS down: wait and compete again
                delay = min(RETRY_S * 2 ** min(failures, 16), RETRY_MAX_S)  # 2.0**1024 overflows a float
                failures += 1
                log.warning("projector of %s: %r; retrying in %.1f s", self.log.settings.namespace, e, delay)
                self.last_error = e
            finally:
                self._decided.set()
                await self._step_down()
            if not self._stopping:
                await asyncio.sleep(delay)

    async def _lead(self) -> None:
        """Take the lock and a new term, then project and watch until one of them ends."""
        base = cancels()
        await self._become_leader()
        tasks = [
            _spawn(self._project(), "eventlight-projection", quiet=True),
            _spawn(self._watch_lock(), "eventlight-projector-lock", quiet=True),
            _spawn(self.watchdog.run(lambda: self._stopping or not self.leader.is_set()), "eventlight-watchdog"),
        ]
        if self.log.settings.retention_s is not None and self.partition == 0:  # retires every partition's
            tasks.append(_spawn(self._retire_loop(self.log.settings.retention_s), "eventlight-retire"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:  # cancelled but not closed: ``asyncio.run`` ends, no read model to tell
            self._set_leader(False, tell=self._stopping or cancels() <= base)
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=5)
            _collect(tasks, raised=sys.exc_info()[1])

    async def _retire_loop(self, retention_s: float) -> None:
        """The leader retires what is due every ``retire_every_s(retention_s)`` (at most
        ``RETIRE_BATCH`` rollouts a round); a failed round is logged and tried again next time."""
        from eventlight.store.jetstream.retire import retire  # only where retirement is on

        every = retire_every_s(retention_s)
        while not self._stopping and self.leader.is_set():
            await asyncio.sleep(every)
            try:
                report = await retire(self.log, self.pool, self.log.settings, now=self.clock(), limit=RETIRE_BATCH)
            except Exception as e:  # NATS or Postgres failing: projection reports it; retirement waits
                log.warning(
                    "retiring rollouts of %s failed: %r; next try in %.0f s", self.log.settings.namespace, e, every
                )
                continue
            self.retired += report.retired

    async def _step_down(self) -> None:
        """Stop leading and give the lock connection back (it unlocks, or it is already gone)."""
        self._set_leader(False)
        conn, self._lock_conn = self._lock_conn, None
        if conn is None:
            return
        if self.share is not None:
            self.share.release(self.partition)
        try:
            if not conn.is_closed():
                await asyncio.wait_for(conn.execute("SELECT pg_advisory_unlock_all()"), 2)
            await self.pool.release(conn, timeout=2)
        except Exception as e:  # lost, or already back in the pool: the lock went with the session
            log.debug("projector: giving the lock connection back: %r", e)
            with contextlib.suppress(Exception):
                conn.terminate()

    def _set_leader(self, leads: bool, *, tell: bool = True) -> None:
        """Set or clear ``leader``, and say so (``on_leadership``, if ``tell``) when that changes it."""
        if leads == self.leader.is_set():
            return
        if leads:
            self.leader.set()
        else:
            self.leader.clear()
        if tell and self.on_leadership is not None:
            self.on_leadership()

    async def _become_leader(self) -> None:
        """Hold the advisory lock, take the next term and read what the watchdog must watch."""
        conn = await self.pool.acquire()
        self._lock_conn = conn
        self._lock_lost.clear()
        conn.add_termination_listener(lambda _c: self._lock_lost.set())
        key = lock_key(self.log.settings.pg_schema, self.partition)
        while not await self._try_lock(conn, key):
            self._decided.set()
            if self._stopping:
                raise Deposed("stopping")
            await asyncio.sleep(0.5)  # a standby polls for the advisory lock
        async with conn.transaction():
            recorded = await conn.fetchval("SELECT partitions FROM projector_partitions")
            if (recorded or 1) != self.partitions:
                raise InvalidInputError(f"the namespace is projected in {recorded} partitions, not {self.partitions}")
            row = await conn.fetchrow(
                "UPDATE projector_checkpoint SET term = term + 1 WHERE id = $1 RETURNING term, last_seq",
                self.partition,
            )
            self.term, self.checkpoint = int(row["term"]), int(row["last_seq"])
            await self._load_in_flight(conn)
            if self.worker_fold is not None:
                await self.worker_fold.start_term(conn)
        self.terms_led += 1
        self._set_leader(True)
        self._decided.set()
        log.info(
            "projector of %s leads partition %d/%d (term %d) from stream sequence %d, %d rollouts in flight",
            self.log.settings.namespace,
            self.partition,
            self.partitions,
            self.term,
            self.checkpoint,
            len(self.states),
        )

    async def _try_lock(self, conn: asyncpg.Connection, key: int) -> bool:
        """Take the partition's advisory lock if it is free and within this process's share."""
        if self.share is not None and not self.share.claim(self.partition):
            return False
        if await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
            return True
        if self.share is not None:
            self.share.release(self.partition)
        return False

    async def _load_in_flight(self, conn: asyncpg.Connection) -> None:
        """Forget what an earlier term cached (another leader may have written since) and read the
        rollouts the watchdog watches (``eventlight.store.fold.watched``: in flight, or finished or
        queued with an attempt still live) from the read model, so it watches them after any restart."""
        self.states.clear()
        self.rollout_seq.clear()
        self.workers.clear()
        rows = await conn.fetch(IN_FLIGHT_SQL)
        if self.partitions > 1:
            rows = [r for r in rows if partition_of(r[0], self.partitions) == self.partition]
        if not rows:
            return
        ids = [r[0] for r in rows]
        attempts: dict[str, list[Any]] = {rid: [] for rid in ids}
        for a in await conn.fetch(
            f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = ANY($1::text[]) ORDER BY rollout_id, sequence_id",
            ids,
        ):
            attempts[a[0]].append(attempt_from_row(a))
        for r in rows:
            state = RolloutState(rollout=rollout_from_row(r), attempts=tuple(attempts[r[0]]))
            if watched(state):  # one not in flight only while a live attempt of it can be marked
                self.states[r[0]] = state
                self.rollout_seq[r[0]] = int(r[9])

    async def _watch_lock(self) -> None:
        """Return (raise ``Deposed``) as soon as the advisory-lock connection is lost."""
        conn = self._lock_conn
        assert conn is not None
        base = cancels()
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lock_lost.wait(), LOCK_PING_S)
            raise_if_cancelled(base)
            if self._lock_lost.is_set() or conn.is_closed():
                raise Deposed("the advisory-lock connection to Postgres was lost")
            if self.share is not None and self.share.surplus(self.partition):
                raise Deposed(f"partition {self.partition} is handed over to a process that leads fewer")
            try:
                await asyncio.wait_for(conn.fetchval("SELECT 1"), LOCK_PING_TIMEOUT_S)
            except Exception as e:
                raise Deposed(f"the advisory-lock connection to Postgres does not answer ({e!r})") from e
            raise_if_cancelled(base)


def _collect(tasks: list[asyncio.Task[None]], raised: BaseException | None) -> None:
    """Take what ended each finished task of a term, so that asyncio does not report one as "Task
    exception was never retrieved" (at ERROR, with its traceback) when the task is collected. A lost
    connection often ends two at once: the lock watch raises ``Deposed``, and the projection,
    cancelled inside an asyncpg query that the same loss ends (asyncpg's timeout can turn the
    cancel into the query's error), raises it too. That, a server failure (``TRANSIENT``) or NATS
    failing (``READ_ERRORS``) is expected: a debug line. Anything else is logged with its traceback,
    but for ``raised``, the one ``_lead`` raises (its caller reports it).
    """
    for t in tasks:
        if not t.done() or t.cancelled() or (e := t.exception()) is None or e is raised:
            continue
        if isinstance(e, NOT_THE_EVENTS + READ_ERRORS):
            log.debug("%s ended with %r as its term ended", t.get_name(), e)
        else:
            log.error("%s ended with %r as its term ended", t.get_name(), e, exc_info=e)
