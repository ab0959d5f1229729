"""The projector: consumes the stream into the Postgres read model, exactly once in effect.

It reads the durable pull consumer ``projector`` (ack policy *all*) in batches, folds each batch with
the projector's fold (``eventlight.store.fold``, the code the in-memory read model runs too), writes
the changed rows of the batch **and** the batch's last stream sequence in one transaction, and acks
the last message only after the commit. On restart it skips every message whose sequence is at or
below the committed checkpoint, so a redelivered batch re-applies nothing. An event that cannot be
projected on its own is recorded in ``projector_dead_letters`` and skipped.

Only one projector per namespace writes at a time: it holds ``pg_advisory_lock`` on a dedicated
connection; a second instance waits as a hot standby. The leader also runs the watchdog
(``eventlight.store.watchdog``) over the rollouts it has in flight.

``rebuild()`` projects the whole log (from sequence 0) into the projector's pool's schema without the
consumer: a fresh schema rebuilt that way must equal the live one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable
from typing import Any

import asyncpg

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError
from eventlight.core.events import AnyEvent
from eventlight.core.types import Worker
from eventlight.core.types import now as wall_clock
from eventlight.store.fold import Changes, Missing, fold_batch, in_flight
from eventlight.store.jetstream.definitions import consumer_config
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.nats_errors import NO_MESSAGES
from eventlight.store.jetstream.pg import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    WORKER_COLS,
    attempt_from_row,
    rollout_from_row,
    worker_from_row,
)
from eventlight.store.jetstream.pg_errors import SERVER_FAILURES
from eventlight.store.jetstream.rows import (
    INSERT_SPAN,
    UPSERT_ATTEMPT,
    UPSERT_RESOURCES,
    UPSERT_ROLLOUT,
    UPSERT_WORKER,
    attempt_row,
    decode_for_projection,
    resources_row,
    rollout_row,
    span_row,
    worker_row,
)
from eventlight.store.watchdog import Watchdog

log = logging.getLogger(__name__)

BATCH = 512
MAX_FOLD_ROUNDS = 8

TRANSIENT = SERVER_FAILURES
"""Failures of the servers rather than of an event: a batch failing with one is retried as it is."""


def _seq_range(msgs: list[Any]) -> str:
    return f"{msgs[0].metadata.sequence.stream}-{msgs[-1].metadata.sequence.stream}"


class _Replayed:
    """A stored message read by ``rebuild`` in the shape ``apply`` takes (no ack)."""

    class _Meta:
        class _Seq:
            def __init__(self, seq: int):
                self.stream = seq

        def __init__(self, seq: int):
            self.sequence = self._Seq(seq)

    def __init__(self, seq: int, subject: str, data: bytes):
        self.metadata = self._Meta(seq)
        self.subject = subject
        self.data = data


class Projector:
    """Projects one namespace's stream into Postgres.

    Args:
        log_: The event log (NATS side).
        pool: A pool whose connections use the namespace's schema (or a fresh one, for ``rebuild``).
        watchdog_interval_s: Seconds between watchdog ticks.
        on_commit: Called after each commit with ``(last_seq, ids of the rollouts that are in a
            terminal status after it)``; ``wait_for_rollouts`` re-reads only when one of its ids is there.
        clock: Wall-clock seconds, for the watchdog.
    """

    def __init__(
        self,
        log_: JetStreamEventLog,
        pool: asyncpg.Pool,
        *,
        watchdog_interval_s: float = 1.0,
        on_commit: Callable[[int, set[str]], None] | None = None,
        clock: Callable[[], float] = wall_clock,
    ):
        self.log = log_
        self.pool = pool
        self.on_commit = on_commit
        self.checkpoint = 0
        self.states: dict[str, RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.workers: dict[str, Worker] = {}
        self.malformed = 0
        self.dead_letters = 0
        self.watchdog = Watchdog(log_, self.in_flight, clock, watchdog_interval_s)
        self.leader = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock_conn: asyncpg.Connection | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start projecting (as leader once the advisory lock is held) and the watchdog."""
        self._tasks.append(_spawn(self._run(), "eventlight-projector"))

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
        if self._lock_conn is not None:
            with contextlib.suppress(Exception):
                await self._lock_conn.execute("SELECT pg_advisory_unlock_all()")
            with contextlib.suppress(Exception):
                await self.pool.release(self._lock_conn, timeout=5)
            self._lock_conn = None

    async def _run(self) -> None:
        await self._become_leader()
        self._tasks.append(_spawn(self.watchdog.run(lambda: self._stopping), "eventlight-watchdog"))
        psub = await self._subscribe()
        while not self._stopping:
            try:
                msgs = await psub.fetch(BATCH, timeout=0.25)
            except NO_MESSAGES:
                continue
            except Exception:
                log.exception("projector fetch failed; retrying in 1 s")
                await asyncio.sleep(1)
                continue
            if not msgs:  # nats-py may return an empty batch (a status message, not an error)
                continue
            await self._apply_until_done(msgs)

    async def _apply_until_done(self, msgs: list[Any]) -> None:
        """Apply and ack one fetched batch, retrying *this* batch until it is done (or the projector
        stops): fetching the next one first would let its ack (policy *all*) acknowledge this one
        unapplied. An event that cannot be projected on its own is dead-lettered (``_apply_isolating``);
        a failure of the servers (``TRANSIENT``) is retried every second."""
        while not self._stopping:
            try:
                try:
                    await self.apply(msgs)
                except TRANSIENT:
                    raise
                except Exception:  # some event of the batch cannot be projected: find it, keep the others
                    await self._apply_isolating(msgs)
                await msgs[-1].ack()
                return
            except Exception:
                log.exception("projector batch (stream sequences %s) failed; retrying it in 1 s", _seq_range(msgs))
                await asyncio.sleep(1)

    async def _apply_isolating(self, msgs: list[Any]) -> None:
        """Apply a batch one message at a time; a message that fails on its own with anything but a
        server failure (``TRANSIENT``) is recorded in ``projector_dead_letters`` and skipped: the
        stream keeps it, and the projection goes on."""
        for msg in msgs:
            try:
                await self.apply([msg])
            except TRANSIENT:
                raise
            except Exception as e:
                seq = msg.metadata.sequence.stream
                log.error("projector: skipping the event at stream sequence %d (%s): %r", seq, msg.subject, e)
                async with self.pool.acquire() as conn, conn.transaction():
                    await conn.execute(
                        "INSERT INTO projector_dead_letters (stream_seq, subject, error) VALUES ($1, $2, $3)"
                        " ON CONFLICT DO NOTHING",
                        seq,
                        msg.subject,
                        f"{type(e).__name__}: {e}"[:2000],
                    )
                    await conn.execute("UPDATE projector_checkpoint SET last_seq = $1, updated_at = now()", seq)
                self.checkpoint = seq
                self.dead_letters += 1
                if self.on_commit is not None:
                    self.on_commit(seq, set())

    async def _become_leader(self) -> None:
        self._lock_conn = await self.pool.acquire()
        key = zlib.crc32(self.log.settings.pg_schema.encode())
        while not await self._lock_conn.fetchval("SELECT pg_try_advisory_lock($1)", key):  # noqa: ASYNC110
            await asyncio.sleep(0.5)  # a standby polls for the advisory lock
        self.checkpoint = int(await self._lock_conn.fetchval("SELECT last_seq FROM projector_checkpoint") or 0)
        self.leader.set()
        log.info("projector of %s leads from stream sequence %d", self.log.settings.namespace, self.checkpoint)

    async def _subscribe(self) -> Any:
        cfg = consumer_config("projector", self.log.settings.namespace)  # streams/003_projector.json
        return await self.log.js.pull_subscribe(
            f"{self.log.prefix}.>", durable="projector", stream=self.log.stream, config=cfg
        )

    async def rebuild(self, batch_size: int = BATCH) -> int:
        """Project the whole log into this projector's schema (empty tables expected), without the
        consumer or the leader lock; returns the last stream sequence applied."""
        self.checkpoint = int(await self.pool.fetchval("SELECT last_seq FROM projector_checkpoint") or 0)
        batch: list[Any] = []
        async for msg in self.log._messages(f"{self.log.prefix}.>", self.checkpoint):
            batch.append(_Replayed(msg.seq, msg.subject, msg.data or b""))
            if len(batch) >= batch_size:
                await self.apply(batch)
                batch = []
        if batch:
            await self.apply(batch)
        return self.checkpoint

    def in_flight(self) -> list[tuple[str, RolloutState, int]]:
        """``(rollout_id, state, version)`` of the rollouts the watchdog watches."""
        return [(rid, self.states[rid], self.rollout_seq.get(rid, 0)) for rid in in_flight(self.states)]

    async def watch_once(self, now: float | None = None) -> int:
        """One watchdog tick; how many attempts it marked ``timeout``/``unresponsive``."""
        return len(await self.watchdog.tick(now))

    # -- applying a batch ---------------------------------------------------------------------

    async def apply(self, msgs: list[Any]) -> None:
        """Fold a batch of messages into rows and commit them with the checkpoint."""
        events: list[tuple[int, AnyEvent]] = []
        last_seq = 0
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= self.checkpoint:
                continue
            last_seq = seq
            try:
                events.append((seq, decode_for_projection(msg.data)))
            except InvalidInputError:
                self.malformed += 1
                log.warning("skipping malformed event at stream sequence %d", seq)
        if last_seq == 0:
            return
        async with self.pool.acquire() as conn:
            batch = await self._fold(conn, events)
            batch.last_seq = last_seq
            async with conn.transaction():
                await self._write(conn, batch)
        self.checkpoint = batch.last_seq
        self.states.update(batch.rollouts)
        self.rollout_seq.update(batch.rollout_seq)
        self.workers.update(batch.workers)
        for rid in batch.terminal:  # finished rollouts are reloaded from Postgres if touched again,
            self.states.pop(rid, None)  # so memory follows the rollouts in flight, not all rollouts
            self.rollout_seq.pop(rid, None)
        if self.on_commit is not None:
            self.on_commit(self.checkpoint, batch.terminal)

    async def _fold(self, conn: asyncpg.Connection, events: list[tuple[int, AnyEvent]]) -> Changes:
        """The fold of ``events``; rollouts and workers it lacks are read from Postgres and the
        batch folded again (the fold is pure, so a second round gives what one would have)."""
        rollouts: dict[str, RolloutState | None] = {}
        workers: dict[str, Worker | None] = {}

        def rollout(rid: str) -> RolloutState | None:
            if rid in self.states:
                return self.states[rid]
            if rid in rollouts:
                return rollouts[rid]
            raise Missing("rollout", rid)

        def worker(wid: str) -> Worker | None:
            if wid in self.workers:
                return self.workers[wid]
            if wid in workers:
                return workers[wid]
            raise Missing("worker", wid)

        for _ in range(MAX_FOLD_ROUNDS):
            try:
                return fold_batch(events, rollout, worker)
            except Missing as m:
                if m.kind == "rollout":
                    rollouts[m.key] = await self._load_rollout(conn, m.key)
                else:
                    workers[m.key] = await self._load_worker(conn, m.key)
        raise RuntimeError(f"the fold still lacked rows after {MAX_FOLD_ROUNDS} reads")

    async def _load_rollout(self, conn: asyncpg.Connection, rid: str) -> RolloutState | None:
        row = await conn.fetchrow(f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE rollout_id = $1", rid)
        if row is None:
            return None
        attempts = await conn.fetch(
            f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = $1 ORDER BY sequence_id", rid
        )
        self.rollout_seq.setdefault(rid, row[9])
        return RolloutState(rollout=rollout_from_row(row), attempts=tuple(attempt_from_row(a) for a in attempts))

    async def _load_worker(self, conn: asyncpg.Connection, wid: str) -> Worker | None:
        row = await conn.fetchrow(f"SELECT {WORKER_COLS} FROM workers WHERE worker_id = $1", wid)
        return worker_from_row(row) if row else None

    async def _write(self, conn: asyncpg.Connection, b: Changes) -> None:
        if b.rollouts:
            await conn.executemany(UPSERT_ROLLOUT, [rollout_row(s, b, self.rollout_seq) for s in b.rollouts.values()])
            attempts = [a for s in b.rollouts.values() for a in s.attempts]
            await conn.executemany(UPSERT_ATTEMPT, [attempt_row(a) for a in attempts])
        if b.spans:
            await conn.executemany(INSERT_SPAN, [span_row(s, seq) for s, seq in b.spans])
        if b.resources:
            await conn.executemany(
                UPSERT_RESOURCES, [resources_row(r, first, last) for r, first, last in b.resources.values()]
            )
        if b.workers:
            rows = [worker_row(w, b.worker_created_seq.get(wid)) for wid, w in b.workers.items()]
            await conn.executemany(UPSERT_WORKER, rows)
        await conn.execute("UPDATE projector_checkpoint SET last_seq = $1, updated_at = now()", b.last_seq)


def _spawn(coro: Any, name: str) -> asyncio.Task[None]:
    """A background task whose unexpected death is logged, never silent."""

    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s stopped: %r", name, task.exception(), exc_info=task.exception())

    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(done)
    return task
