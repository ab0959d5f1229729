"""The projector: applies the stream to the Postgres read model in order, exactly once in effect.

It reads the stream **by sequence from its checkpoint** (an ephemeral, unacknowledged pull consumer
that starts at ``checkpoint + 1``; a gap in the consumer's delivery sequence, a lost consumer or any
fetch error re-creates it from the checkpoint), folds each batch with the projector's fold
(``eventlight.store.fold``, the code the in-memory read model runs too) and writes the changed rows
of the batch **and** the batch's last stream sequence in one transaction. Nothing depends on
redelivery or acknowledgements, so a projector killed mid-batch loses nothing: the next one starts
after the last committed sequence, and the checkpoint never moves past a sequence it did not apply.
An event that cannot be projected (malformed, or refused on its own) is recorded in
``projector_dead_letters`` in the batch's transaction, and the projection goes on.

One projector per namespace writes at a time, and this is fenced, not assumed:

* a leader holds ``pg_advisory_lock`` on a dedicated connection (a second instance waits as a hot
  standby), and stops leading the moment that connection is lost (``pg_terminate_backend``, a
  Postgres restart): a termination listener and a ping every ``LOCK_PING_S``;
* taking the lock takes the next *term* (``projector_checkpoint.term``, migration 007), and every
  batch moves the checkpoint with ``UPDATE ... WHERE term = <its term> AND last_seq = <where it
  applied from>`` first in its transaction: a deposed projector updates no row, raises ``Deposed``,
  and its transaction rolls back. It then competes for the lock again, as a standby.

The leader also runs the watchdog (``eventlight.store.watchdog``) over the rollouts in flight, which
it reads from the read model when it takes the lead (so a restart forgets no running attempt).

``rebuild()`` projects the whole log (from sequence 0) into the projector's pool's schema without
the consumer: a fresh schema rebuilt that way must equal the live one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
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
from eventlight.store.jetstream.nats_errors import ANY_NATS_ERROR, NO_MESSAGES
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
LOCK_PING_S = 0.5
"""Seconds between pings of the advisory-lock connection (its loss is also noticed at once)."""
LOCK_PING_TIMEOUT_S = 2.0
RETRY_S = 0.5
START_DECIDE_S = 5.0
RETRY_MAX_S = 5.0

TRANSIENT = SERVER_FAILURES
"""Failures of the servers rather than of an event: a batch failing with one is retried as it is."""


class Deposed(Exception):  # noqa: N818 - a state, not a bug
    """This projector no longer leads: its lock connection is lost, or another took a newer term."""


class _Gap(Exception):  # noqa: N818 - a signal
    """The consumer skipped a delivery: read again from the checkpoint."""


NOT_THE_EVENTS: tuple[type[BaseException], ...] = (Deposed, *TRANSIENT)
"""Failures that say nothing about the events of a batch (never dead-lettered)."""
READ_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT, *ANY_NATS_ERROR)


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
        self.term = 0
        self.states: dict[str, RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.workers: dict[str, Worker] = {}
        self.malformed = 0
        self.dead_letters = 0
        self.terms_led = 0
        self.watchdog = Watchdog(log_, self.in_flight, clock, watchdog_interval_s)
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
        delay = RETRY_S
        while not self._stopping:
            try:
                await self._lead()
                delay = RETRY_S
            except Deposed as e:
                log.warning("projector of %s stopped leading (term %d): %s", self.log.settings.namespace, self.term, e)
                self.last_error = e
                delay = RETRY_S
            except Exception as e:  # Postgres or NATS down: wait and compete again
                log.warning("projector of %s: %r; retrying in %.1f s", self.log.settings.namespace, e, delay)
                self.last_error = e
                delay = min(delay * 2, RETRY_MAX_S)
            finally:
                self._decided.set()
                await self._step_down()
            if not self._stopping:
                await asyncio.sleep(delay)

    async def _lead(self) -> None:
        """Take the lock and a new term, then project and watch until one of them ends."""
        await self._become_leader()
        tasks = [
            _spawn(self._project(), "eventlight-projection", quiet=True),
            _spawn(self._watch_lock(), "eventlight-projector-lock", quiet=True),
            _spawn(self.watchdog.run(lambda: self._stopping or not self.leader.is_set()), "eventlight-watchdog"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            self.leader.clear()
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=5)

    async def _step_down(self) -> None:
        """Stop leading and give the lock connection back (it unlocks, or it is already gone)."""
        self.leader.clear()
        conn, self._lock_conn = self._lock_conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed():
                await asyncio.wait_for(conn.execute("SELECT pg_advisory_unlock_all()"), 2)
            await self.pool.release(conn, timeout=2)
        except Exception as e:  # lost, or already back in the pool: the lock went with the session
            log.debug("projector: giving the lock connection back: %r", e)
            with contextlib.suppress(Exception):
                conn.terminate()

    async def _become_leader(self) -> None:
        """Hold the advisory lock, take the next term and read what the watchdog must watch."""
        conn = await self.pool.acquire()
        self._lock_conn = conn
        self._lock_lost.clear()
        conn.add_termination_listener(lambda _c: self._lock_lost.set())
        key = zlib.crc32(self.log.settings.pg_schema.encode())
        while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):  # noqa: ASYNC110
            self._decided.set()
            if self._stopping:
                raise Deposed("stopping")
            await asyncio.sleep(0.5)  # a standby polls for the advisory lock
        async with conn.transaction():
            row = await conn.fetchrow("UPDATE projector_checkpoint SET term = term + 1 RETURNING term, last_seq")
            self.term, self.checkpoint = int(row["term"]), int(row["last_seq"])
            await self._load_in_flight(conn)
        self.terms_led += 1
        self.leader.set()
        self._decided.set()
        log.info(
            "projector of %s leads (term %d) from stream sequence %d, %d rollouts in flight",
            self.log.settings.namespace,
            self.term,
            self.checkpoint,
            len(self.states),
        )

    async def _load_in_flight(self, conn: asyncpg.Connection) -> None:
        """Forget what an earlier term cached (another leader may have written since) and read the
        rollouts in flight from the read model, so the watchdog watches them after any restart."""
        self.states.clear()
        self.rollout_seq.clear()
        self.workers.clear()
        rows = await conn.fetch(
            f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE status IN ('preparing', 'running')"
        )
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
            self.states[r[0]] = RolloutState(rollout=rollout_from_row(r), attempts=tuple(attempts[r[0]]))
            self.rollout_seq[r[0]] = int(r[9])

    async def _watch_lock(self) -> None:
        """Return (raise ``Deposed``) as soon as the advisory-lock connection is lost."""
        conn = self._lock_conn
        assert conn is not None
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lock_lost.wait(), LOCK_PING_S)
            if self._lock_lost.is_set() or conn.is_closed():
                raise Deposed("the advisory-lock connection to Postgres was lost")
            try:
                await asyncio.wait_for(conn.fetchval("SELECT 1"), LOCK_PING_TIMEOUT_S)
            except Exception as e:
                raise Deposed(f"the advisory-lock connection to Postgres does not answer ({e!r})") from e

    async def _project(self) -> None:
        """Read the stream from the checkpoint and apply it batch by batch, in order."""
        while not self._stopping:
            psub = await self._subscribe(self.checkpoint)
            try:
                await self._consume(psub)
            except _Gap as e:
                log.warning("projector: %s; reading again from stream sequence %d", e, self.checkpoint + 1)
            except (Deposed, asyncio.CancelledError):
                raise
            except READ_ERRORS as e:
                log.warning("projector: reading the stream failed (%r); reading again from the checkpoint", e)
                await asyncio.sleep(RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.log.js.delete_consumer(self.log.stream, psub._consumer), 2)

    async def _consume(self, psub: Any) -> None:
        delivered = 0  # the consumer's delivery sequence: no acks, so no redelivery, so no gap
        while not self._stopping:
            try:
                msgs = await psub.fetch(BATCH, timeout=0.25)
            except NO_MESSAGES:
                continue
            if not msgs:  # nats-py may return an empty batch (a status message, not an error)
                continue
            for i, msg in enumerate(msgs):
                if msg.metadata.sequence.consumer != delivered + 1:
                    msgs = msgs[:i]
                    if msgs:
                        await self._apply_until_done(msgs)
                    raise _Gap(f"delivery {delivered + 1} expected, {msg.metadata.sequence.consumer} came")
                delivered += 1
            await self._apply_until_done(msgs)

    async def _apply_until_done(self, msgs: list[Any]) -> None:
        """Apply one fetched batch, retrying *this* batch until it is done (or the projector stops
        or is deposed): the checkpoint moves only past what was applied. An event that cannot be
        projected on its own is dead-lettered (``_apply_isolating``); a failure of the servers
        (``TRANSIENT``) is retried every second."""
        while not self._stopping:
            try:
                try:
                    await self.apply(msgs)
                except NOT_THE_EVENTS:
                    raise
                except Exception:  # some event of the batch cannot be projected: find it, keep the others
                    await self._apply_isolating(msgs)
                return
            except Deposed:
                raise
            except Exception:
                log.exception("projector batch (stream sequences %s) failed; retrying it in 1 s", _seq_range(msgs))
                if self._lock_lost.is_set():
                    raise Deposed("the advisory-lock connection to Postgres was lost") from None
                await asyncio.sleep(1)

    async def _apply_isolating(self, msgs: list[Any]) -> None:
        """Apply a batch one message at a time; a message that fails on its own with anything but a
        server failure (``TRANSIENT``) is recorded in ``projector_dead_letters`` and skipped: the
        stream keeps it, and the projection goes on."""
        for msg in msgs:
            try:
                await self.apply([msg])
            except NOT_THE_EVENTS:
                raise
            except Exception as e:
                seq = msg.metadata.sequence.stream
                log.error("projector: skipping the event at stream sequence %d (%s): %r", seq, msg.subject, e)
                async with self.pool.acquire() as conn, conn.transaction():
                    await self._advance(conn, seq)
                    await self._dead_letter(conn, [(seq, msg.subject, f"{type(e).__name__}: {e}")])
                self.checkpoint = seq
                self.dead_letters += 1
                if self.on_commit is not None:
                    self.on_commit(seq, set())

    async def _advance(self, conn: asyncpg.Connection, last_seq: int) -> None:
        """Move the checkpoint to ``last_seq``, fenced: only this term's leader, only from where it
        applied. First in the batch's transaction, so the row lock also orders the batch against a
        new leader taking its term.

        Raises:
            Deposed: Another projector took a newer term (or moved the checkpoint).
        """
        status = await conn.execute(
            "UPDATE projector_checkpoint SET last_seq = $1, updated_at = now() WHERE term = $2 AND last_seq = $3",
            last_seq,
            self.term,
            self.checkpoint,
        )
        if status != "UPDATE 1":
            raise Deposed(f"the checkpoint row is no longer term {self.term} at sequence {self.checkpoint}")

    async def _dead_letter(self, conn: asyncpg.Connection, rows: list[tuple[int, str, str]]) -> None:
        await conn.executemany(
            "INSERT INTO projector_dead_letters (stream_seq, subject, error) VALUES ($1, $2, $3)"
            " ON CONFLICT DO NOTHING",
            [(seq, subject, error[:2000]) for seq, subject, error in rows],
        )

    async def _subscribe(self, after_seq: int) -> Any:
        """An ephemeral consumer of the whole namespace from stream sequence ``after_seq + 1``,
        without acknowledgements (the checkpoint in Postgres is the position)."""
        template = consumer_config("projector", self.log.settings.namespace)  # streams/003_projector.json
        cfg = dataclasses.replace(
            template, name=f"projector-{self.term}-{uuid.uuid4().hex[:8]}", opt_start_seq=after_seq + 1
        )
        return await self.log.js.pull_subscribe(f"{self.log.prefix}.>", stream=self.log.stream, config=cfg)

    async def rebuild(self, batch_size: int = BATCH) -> int:
        """Project the whole log into this projector's schema (empty tables expected), without the
        consumer or the leader lock; returns the last stream sequence applied."""
        row = await self.pool.fetchrow("SELECT term, last_seq FROM projector_checkpoint")
        self.term, self.checkpoint = int(row["term"]), int(row["last_seq"])
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
        """Fold a batch of messages into rows and commit them with the checkpoint (fenced by the
        term, ``_advance``); a message that is not an event is dead-lettered in the same transaction.

        Raises:
            Deposed: Another projector leads now; nothing of the batch was written.
        """
        events: list[tuple[int, AnyEvent]] = []
        malformed: list[tuple[int, str, str]] = []
        last_seq = 0
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= self.checkpoint:
                continue
            last_seq = seq
            try:
                events.append((seq, decode_for_projection(msg.data)))
            except InvalidInputError as e:
                malformed.append((seq, msg.subject, f"malformed event: {e}"))
                log.warning(
                    "projector: dead-lettering the malformed event at stream sequence %d (%s)", seq, msg.subject
                )
        if last_seq == 0:
            return
        async with self.pool.acquire() as conn:
            batch = await self._fold(conn, events)
            batch.last_seq = last_seq
            async with conn.transaction():
                await self._advance(conn, last_seq)
                await self._write(conn, batch)
                if malformed:
                    await self._dead_letter(conn, malformed)
        self.checkpoint = batch.last_seq
        self.malformed += len(malformed)
        self.dead_letters += len(malformed)
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


def _spawn(coro: Any, name: str, *, quiet: bool = False) -> asyncio.Task[None]:
    """A background task whose unexpected death is logged, never silent (``quiet``: its awaiter
    handles the exception)."""

    def done(task: asyncio.Task[None]) -> None:
        if not quiet and not task.cancelled() and task.exception() is not None:
            log.error("%s stopped: %r", name, task.exception(), exc_info=task.exception())

    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(done)
    return task
