"""The projector: consumes the stream into the Postgres read models, exactly once in effect.

It reads the durable pull consumer ``projector`` (ack policy *all*) in batches, folds each event
into the rollout states with ``decider.evolve`` (the same rules as every backend), writes the
changed rows of the batch **and** the batch's last stream sequence in one transaction, and acks
the last message only after the commit. On restart it skips every message whose sequence is at
or below the committed checkpoint, so a redelivered batch re-applies nothing.

Only one projector per namespace writes at a time: it holds ``pg_advisory_lock`` on a dedicated
connection; a second instance waits as a hot standby.

The watchdog runs in the same task group: every ``watchdog_interval_s`` seconds it asks the decider
(``CheckHealth``) about every rollout that is ``preparing`` or ``running`` in the projector's
states, which include span heartbeats, and appends the ``timeout``/``unresponsive`` events it
decides, with the rollout's expected sequence. It therefore times out attempts even when nobody
calls the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable
from typing import Any

import asyncpg
import msgspec
import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from eventlight import decider as d
from eventlight.errors import InvalidInputError
from eventlight.events import (
    AnyEvent,
    ResourcesPut,
    RolloutCreated,
    SpansAdded,
    decode_event,
    rollout_id_of,
)
from eventlight.store.eventlog import EventLog, StaleStateError
from eventlight.store.pg import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    WORKER_COLS,
    attempt_from_row,
    dumps,
    rollout_from_row,
    text,
    worker_from_row,
)
from eventlight.types import Span, Worker

log = logging.getLogger(__name__)

BATCH = 512

TRANSIENT: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,  # 08: connection lost
    asyncpg.exceptions.OperatorInterventionError,  # 57: shutdown, cancelled
    asyncpg.exceptions.InsufficientResourcesError,  # 53: disk full, too many connections
    asyncpg.exceptions.TransactionRollbackError,  # 40: serialization failure, deadlock
    asyncpg.exceptions.LockNotAvailableError,
)
"""Failures of the servers rather than of an event: a batch failing with one is retried as it is."""


def _seq_range(msgs: list[Any]) -> str:
    return f"{msgs[0].metadata.sequence.stream}-{msgs[-1].metadata.sequence.stream}"


class _RawSpan(Span, kw_only=True):
    """A ``Span`` as the projector writes it: its ``attributes`` kept as the event's own JSON text,
    which Postgres parses into ``jsonb`` anyway (decoding them into a dict and encoding them again
    was ~15% of the projector's CPU with the bench's 4 KB attribute sets)."""

    attributes: msgspec.Raw = msgspec.Raw(b"{}")  # type: ignore[assignment]


class _RawSpansAdded(msgspec.Struct, frozen=True, kw_only=True, tag="spans_added", tag_field="type"):
    """``SpansAdded`` (version 1) with ``_RawSpan``s; anything else goes through ``decode_event``."""

    v: int = 1
    time: float
    rollout_id: str
    attempt_id: str
    spans: list[_RawSpan]
    seq_high: int = 0


_raw_spans_decoder = msgspec.json.Decoder(_RawSpansAdded)
_SPANS_ADDED_PREFIX = b'{"type":"spans_added"'


def decode_for_projection(data: bytes) -> AnyEvent:
    """``decode_event``, except that a version-1 ``SpansAdded`` keeps its spans' attributes as raw
    JSON objects (its ``spans`` are ``_RawSpan``s; ``decider.evolve`` does not look into them).

    Raises:
        InvalidInputError: The payload is not a known event.
    """
    if data and data.startswith(_SPANS_ADDED_PREFIX):
        try:
            raw = _raw_spans_decoder.decode(data)
        except (msgspec.DecodeError, RecursionError):  # DecodeError includes ValidationError
            pass  # an older version, or malformed: decode_event upcasts or explains
        else:
            if raw.v == 1 and all(memoryview(sp.attributes)[:1] == b"{" for sp in raw.spans):
                return SpansAdded(
                    time=raw.time,
                    rollout_id=raw.rollout_id,
                    attempt_id=raw.attempt_id,
                    spans=raw.spans,  # type: ignore[arg-type]
                    seq_high=raw.seq_high,
                )
    return decode_event(data)


class _Batch:
    def __init__(self) -> None:
        self.rollouts: dict[str, d.RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.created_seq: dict[str, int] = {}
        self.spans: list[tuple[Any, ...]] = []
        self.resources: dict[str, tuple[Any, int, int]] = {}
        self.workers: dict[str, Worker] = {}
        self.last_seq = 0
        self.terminal: set[str] = set()


class Projector:
    """Projects one namespace's stream into Postgres.

    Args:
        log_: The event log (NATS side).
        pool: A pool whose connections use the namespace's schema.
        watchdog_interval_s: Seconds between watchdog passes.
        on_commit: Called after each commit with ``(last_seq, ids of the rollouts that are in a
            terminal status after it)``; ``wait_for_rollouts`` re-reads only when one of its ids is there.
        durable: Name of the JetStream consumer it reads (``projector``, from ``streams/``). A
            rebuild passes a new name and a pool on a fresh schema: the consumer is created at
            stream sequence 1, so the same code folds the whole log into empty tables.
    """

    def __init__(
        self,
        log_: EventLog,
        pool: asyncpg.Pool,
        *,
        watchdog_interval_s: float = 1.0,
        on_commit: Callable[[int, set[str]], None] | None = None,
        durable: str = "projector",
    ):
        self.log = log_
        self.durable = durable
        self.pool = pool
        self.watchdog_interval_s = watchdog_interval_s
        self.on_commit = on_commit
        self.checkpoint = 0
        self.states: dict[str, d.RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.workers: dict[str, Worker] = {}
        self.malformed = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._lock_conn: asyncpg.Connection | None = None
        self.leader = asyncio.Event()
        self._stopping = False
        self.dead_letters = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
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
        self._tasks.append(_spawn(self._watchdog(), "eventlight-watchdog"))
        psub = await self._subscribe()
        while not self._stopping:
            try:
                msgs = await psub.fetch(BATCH, timeout=0.25)
            except (TimeoutError, nats.errors.TimeoutError):
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
        # one writer per schema it writes (the pool's), so a rebuild into another schema is not a standby
        schema = await self._lock_conn.fetchval("SELECT current_schema()") or self.log.settings.pg_schema
        key = zlib.crc32(schema.encode())
        while not await self._lock_conn.fetchval("SELECT pg_try_advisory_lock($1)", key):  # noqa: ASYNC110
            await asyncio.sleep(0.5)  # a standby polls for the advisory lock
        self.checkpoint = int(await self._lock_conn.fetchval("SELECT last_seq FROM projector_checkpoint") or 0)
        self.leader.set()
        log.info("projector of %s leads from stream sequence %d", self.log.settings.namespace, self.checkpoint)

    async def _subscribe(self) -> Any:
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.ALL,
            ack_wait=60,
            max_ack_pending=20000,
            deliver_policy=DeliverPolicy.ALL,
        )
        return await self.log.js.pull_subscribe(
            f"{self.log.prefix}.>", durable=self.durable, stream=self.log.stream, config=cfg
        )

    # -- applying a batch ---------------------------------------------------------------------

    async def apply(self, msgs: list[Any]) -> None:
        """Fold a batch of messages into rows and commit them with the checkpoint."""
        batch = _Batch()
        async with self.pool.acquire() as conn:
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq <= self.checkpoint:
                    continue
                batch.last_seq = seq
                try:
                    event = decode_for_projection(msg.data)
                except InvalidInputError:
                    self.malformed += 1
                    log.warning("skipping malformed event at stream sequence %d", seq)
                    continue
                await self._fold(conn, batch, event, seq)
            if batch.last_seq == 0:
                return
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

    async def _state(self, conn: asyncpg.Connection, batch: _Batch, rid: str) -> d.RolloutState | None:
        if rid in batch.rollouts:
            return batch.rollouts[rid]
        if rid in self.states:
            return self.states[rid]
        row = await conn.fetchrow(f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE rollout_id = $1", rid)
        if row is None:
            return None
        attempts = await conn.fetch(
            f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = $1 ORDER BY sequence_id", rid
        )
        self.rollout_seq[rid] = row[9]
        return d.RolloutState(rollout=rollout_from_row(row), attempts=tuple(attempt_from_row(a) for a in attempts))

    async def _fold(self, conn: asyncpg.Connection, batch: _Batch, event: AnyEvent, seq: int) -> None:
        rid = rollout_id_of(event)
        if rid is not None:
            # a created rollout is new (ids are unique, creation expects an empty subject): no lookup
            old = None if isinstance(event, RolloutCreated) else await self._state(conn, batch, rid)
            new = d.evolve(old, event)
            if new is not None:
                batch.rollouts[rid] = new
                if old is None:
                    batch.created_seq[rid] = seq
                if not isinstance(event, SpansAdded):
                    batch.rollout_seq[rid] = seq
                if new.rollout.status in ("succeeded", "failed", "cancelled"):
                    batch.terminal.add(rid)
                else:
                    batch.terminal.discard(rid)
            if isinstance(event, SpansAdded) and new is not None:
                batch.spans.extend(_span_row(s, seq) for s in event.spans)
        elif isinstance(event, ResourcesPut):
            rid_ = event.resources.resources_id
            first = batch.resources[rid_][1] if rid_ in batch.resources else seq
            batch.resources[rid_] = (event.resources, first, seq)
        for wid in d.workers_of(event):
            current = batch.workers.get(wid) or self.workers.get(wid) or await self._load_worker(conn, wid)
            w = d.evolve_worker(current, event, wid)
            if w is not None:
                batch.workers[wid] = w

    async def _load_worker(self, conn: asyncpg.Connection, wid: str) -> Worker | None:
        row = await conn.fetchrow(f"SELECT {WORKER_COLS} FROM workers WHERE worker_id = $1", wid)
        return worker_from_row(row) if row else None

    async def _write(self, conn: asyncpg.Connection, b: _Batch) -> None:
        if b.rollouts:
            await conn.executemany(UPSERT_ROLLOUT, [_rollout_row(s, b, self.rollout_seq) for s in b.rollouts.values()])
            attempts = [a for s in b.rollouts.values() for a in s.attempts]
            await conn.executemany(UPSERT_ATTEMPT, [_attempt_row(a) for a in attempts])
        if b.spans:
            await conn.executemany(INSERT_SPAN, b.spans)
        if b.resources:
            await conn.executemany(
                UPSERT_RESOURCES, [_resources_row(r, first, last) for r, first, last in b.resources.values()]
            )
        if b.workers:
            await conn.executemany(UPSERT_WORKER, [_worker_row(w) for w in b.workers.values()])
        await conn.execute("UPDATE projector_checkpoint SET last_seq = $1, updated_at = now()", b.last_seq)

    # -- watchdog --------------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.watchdog_interval_s)
            try:
                await self.watch_once()
            except Exception:
                log.exception("watchdog pass failed")

    async def watch_once(self, now: float | None = None) -> int:
        """One watchdog pass; returns how many attempts it marked ``timeout``/``unresponsive``."""
        at = self.log.now() if now is None else now
        marked = 0
        for rid, state in list(self.states.items()):
            events = d.decide(state, d.CheckHealth(), at)
            if not events:
                continue
            try:
                await self.log.append(events, self.rollout_seq.get(rid, 0), f"watchdog:{rid}:{at}")
                marked += 1
                log.info(
                    "watchdog: rollout %s attempt %s -> %s",
                    rid,
                    events[0].attempt.attempt_id,  # type: ignore[union-attr]
                    events[0].attempt.status,
                )  # type: ignore[union-attr]
            except StaleStateError:
                continue  # something newer happened; the next pass sees it
        return marked


def _spawn(coro: Any, name: str) -> asyncio.Task[None]:
    """A background task whose unexpected death is logged, never silent."""

    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s stopped: %r", name, task.exception(), exc_info=task.exception())

    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(done)
    return task


def _span_row(s: Any, seq: int) -> tuple[Any, ...]:
    return (
        s.rollout_id,
        s.attempt_id,
        text(s.span_id),
        s.sequence_id,
        text(s.trace_id),
        text(s.parent_id),
        text(s.name),
        dumps(s.status),
        _raw_attributes(s.attributes) if type(s) is _RawSpan else dumps(s.attributes),
        dumps(s.events),
        dumps(s.links),
        s.start_time,
        s.end_time,
        dumps(s.context) if s.context is not None else None,
        dumps(s.parent) if s.parent is not None else None,
        dumps(s.resource),
        seq,
    )


def _raw_attributes(raw: msgspec.Raw) -> str:
    """Raw JSON attributes as a ``jsonb`` parameter, NUL characters replaced as ``pg.dumps`` does."""
    data = bytes(raw)
    if b"\\u0000" in data:
        return dumps(msgspec.json.decode(data))
    return data.decode()


def _rollout_row(s: d.RolloutState, b: _Batch, known_seq: dict[str, int]) -> tuple[Any, ...]:
    r = s.rollout
    rid = r.rollout_id
    return (
        rid,
        dumps(r.input),
        r.start_time,
        r.end_time,
        r.mode,
        r.resources_id,
        r.status,
        dumps(r.config),
        dumps(r.metadata),
        s.latest.attempt_id if s.latest else None,
        len(s.attempts),
        b.created_seq.get(rid, 0),
        b.rollout_seq.get(rid, known_seq.get(rid, 0)),
    )


def _attempt_row(a: Any) -> tuple[Any, ...]:
    return (
        a.rollout_id,
        a.attempt_id,
        a.sequence_id,
        a.start_time,
        a.end_time,
        a.status,
        a.worker_id,
        a.last_heartbeat_time,
        dumps(a.metadata),
    )


def _resources_row(r: Any, first_seq: int, last_seq: int) -> tuple[Any, ...]:
    return (r.resources_id, r.create_time, r.update_time, r.version, dumps(r.resources), first_seq, last_seq)


def _worker_row(w: Worker) -> tuple[Any, ...]:
    return (
        w.worker_id,
        w.status,
        dumps(w.heartbeat_stats),
        w.last_heartbeat_time,
        w.last_dequeue_time,
        w.last_busy_time,
        w.last_idle_time,
        w.current_rollout_id,
        w.current_attempt_id,
    )


UPSERT_ROLLOUT = """
INSERT INTO rollouts (rollout_id, input, start_time, end_time, mode, resources_id, status, config, metadata,
                      latest_attempt_id, num_attempts, created_seq, last_seq)
VALUES ($1, $2::jsonb, $3, $4, $5, $6, $7, $8::jsonb, $9::jsonb, $10, $11, $12, $13)
ON CONFLICT (rollout_id) DO UPDATE SET
  input = EXCLUDED.input, end_time = EXCLUDED.end_time, mode = EXCLUDED.mode,
  resources_id = EXCLUDED.resources_id, status = EXCLUDED.status, config = EXCLUDED.config,
  metadata = EXCLUDED.metadata, latest_attempt_id = EXCLUDED.latest_attempt_id,
  num_attempts = EXCLUDED.num_attempts, last_seq = GREATEST(rollouts.last_seq, EXCLUDED.last_seq)
"""

UPSERT_ATTEMPT = """
INSERT INTO attempts (rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id,
                      last_heartbeat_time, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb)
ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET
  end_time = EXCLUDED.end_time, status = EXCLUDED.status, worker_id = EXCLUDED.worker_id,
  last_heartbeat_time = EXCLUDED.last_heartbeat_time, metadata = EXCLUDED.metadata
"""

INSERT_SPAN = """
INSERT INTO spans (rollout_id, attempt_id, span_id, sequence_id, trace_id, parent_id, name, status, attributes,
                   events, links, start_time, end_time, context, parent, resource, stream_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9::jsonb, $10::jsonb, $11::jsonb, $12, $13, $14::jsonb,
        $15::jsonb, $16::jsonb, $17)
ON CONFLICT (rollout_id, attempt_id, span_id) DO NOTHING
"""

UPSERT_RESOURCES = """
INSERT INTO resources (resources_id, create_time, update_time, version, resources, created_seq, last_seq)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7)
ON CONFLICT (resources_id) DO UPDATE SET
  update_time = EXCLUDED.update_time, version = EXCLUDED.version, resources = EXCLUDED.resources,
  last_seq = EXCLUDED.last_seq
"""

UPSERT_WORKER = """
INSERT INTO workers (worker_id, status, heartbeat_stats, last_heartbeat_time, last_dequeue_time, last_busy_time,
                     last_idle_time, current_rollout_id, current_attempt_id)
VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9)
ON CONFLICT (worker_id) DO UPDATE SET
  status = EXCLUDED.status, heartbeat_stats = EXCLUDED.heartbeat_stats,
  last_heartbeat_time = EXCLUDED.last_heartbeat_time, last_dequeue_time = EXCLUDED.last_dequeue_time,
  last_busy_time = EXCLUDED.last_busy_time, last_idle_time = EXCLUDED.last_idle_time,
  current_rollout_id = EXCLUDED.current_rollout_id, current_attempt_id = EXCLUDED.current_attempt_id
"""
