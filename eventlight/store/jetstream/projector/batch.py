"""Applying one batch: the fold, its rows and the checkpoint in one transaction (mixed into ``Projector``).

In a partitioned projection (``partition``) a batch is the whole stream's, and only the messages of
this partition's rollouts are decoded and folded; the checkpoint still moves to the batch's last
sequence. Partition 0 also folds the worker side of every partition's attempt events (``workers``).
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import asyncpg

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError
from eventlight.core.events import AnyEvent, RolloutCreated, rollout_id_of
from eventlight.core.types import Worker
from eventlight.store.fold import Changes, Missing, fold_batch, watched
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.pg import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    WORKER_COLS,
    attempt_from_row,
    rollout_from_row,
    worker_from_row,
)
from eventlight.store.jetstream.projector.common import Deposed
from eventlight.store.jetstream.projector.partition import partition_of
from eventlight.store.jetstream.projector.workers import Item, WorkerChanges, WorkerFold, worker_ids_of
from eventlight.store.jetstream.rows import (
    INSERT_SPAN,
    SPAN_COLUMNS,
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

log = logging.getLogger(__name__)

UPSERT_ATTEMPT_WORKER = (
    "INSERT INTO projector_attempt_workers (attempt_id, worker_id, status) VALUES ($1, $2, $3)"
    " ON CONFLICT (attempt_id) DO UPDATE SET worker_id = EXCLUDED.worker_id, status = EXCLUDED.status"
)

# The pool's sessions plan each statement for its parameters (``force_custom_plan``, see
# ``pg.create_pool``: reads filter on skewed columns). The projector's writes go by primary key, so
# one plan serves them all; without this, every row of an ``executemany`` and every statement of
# the status-count trigger was planned again (13 % of Postgres's CPU in ``batch_nosleep``, perf).
GENERIC_PLANS = "SET LOCAL plan_cache_mode = force_generic_plan"


class BatchWriter:
    """Folds a batch of messages and commits its rows with the checkpoint, fenced by the term."""

    log: JetStreamEventLog
    pool: asyncpg.Pool
    on_commit: Callable[[int, set[str]], None] | None
    checkpoint: int
    term: int
    states: dict[str, RolloutState]
    rollout_seq: dict[str, int]
    workers: dict[str, Worker]
    malformed: int
    dead_letters: int
    partition: int
    partitions: int
    worker_fold: WorkerFold | None

    async def _advance(self, conn: asyncpg.Connection, last_seq: int, *, savepoint: bool = False) -> None:
        """Move the checkpoint to ``last_seq``, fenced: only this term's leader, only from where it
        applied. First in the batch's transaction, so the row lock also orders the batch against a
        new leader taking its term. With no transaction open on ``conn``, it opens the batch's
        (``BEGIN``, ``GENERIC_PLANS`` and, with ``savepoint``, the spans' ``SAVEPOINT``) in the same
        round trip: one simple query, its numbers inlined.

        Raises:
            Deposed: Another projector took a newer term (or moved the checkpoint); the transaction
                stays open, for the caller to roll back.
        """
        update = (
            f"UPDATE projector_checkpoint SET last_seq = {int(last_seq)}, updated_at = now()"
            f" WHERE id = {int(self.partition)} AND term = {int(self.term)} AND last_seq = {int(self.checkpoint)}"
        )
        opens = ""
        if not conn.is_in_transaction():
            opens = f"BEGIN; {GENERIC_PLANS}; " + ("SAVEPOINT spans; " if savepoint else "")
        status = await conn.execute(opens + update)  # a simple query: the status of its last statement
        if status != "UPDATE 1":
            raise Deposed(f"the checkpoint row is no longer term {self.term} at sequence {self.checkpoint}")

    async def _dead_letter(self, conn: asyncpg.Connection, rows: list[tuple[int, str, str]]) -> None:
        await conn.executemany(
            "INSERT INTO projector_dead_letters (stream_seq, subject, error) VALUES ($1, $2, $3)"
            " ON CONFLICT DO NOTHING",
            [(seq, subject, error[:2000]) for seq, subject, error in rows],
        )

    # -- applying a batch ---------------------------------------------------------------------

    async def apply(self, msgs: list[Any]) -> None:
        """Fold a batch of messages into rows and commit them with the checkpoint (fenced by the
        term, ``_advance``); a message that is not an event is dead-lettered in the same transaction.

        Raises:
            Deposed: Another projector leads now; nothing of the batch was written.
        """
        events: list[tuple[int, AnyEvent]] = []
        malformed: list[tuple[int, str, str]] = []
        items: list[Item] = []  # partition 0 of several: the worker side of every partition's events
        last_seq = 0
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= self.checkpoint:
                continue
            last_seq = seq
            own, item = self._classify(seq, msg)
            if item is not None:
                items.append(item)
            if not own:
                continue
            try:
                events.append((seq, decode_for_projection(msg.data)))
            except InvalidInputError as e:
                malformed.append((seq, msg.subject, f"malformed event: {e}"))
                log.warning(
                    "projector: dead-lettering the malformed event at stream sequence %d (%s)", seq, msg.subject
                )
                continue
            if item is not None:
                items[-1] = item._replace(event=events[-1][1])
        if last_seq == 0:
            return
        async with self.pool.acquire() as conn:
            try:  # the transaction by hand: BEGIN goes with the checkpoint's update (``_advance``)
                batch = await self._fold(conn, events)
                batch.last_seq = last_seq
                workers = await self._fold_workers(conn, batch, items)
                await self._advance(conn, last_seq, savepoint=bool(batch.spans))
                await self._write(conn, batch)
                if workers is not None and workers.attempts:
                    await conn.executemany(UPSERT_ATTEMPT_WORKER, [(k, *v) for k, v in workers.attempts.items()])
                if malformed:
                    await self._dead_letter(conn, malformed)
                status = await conn.execute("COMMIT")
            except BaseException as e:
                await _roll_back(
                    conn, cut=not isinstance(e, Exception), stuck=isinstance(e, asyncpg.InternalClientError)
                )
                raise
            if status != "COMMIT":  # Postgres answers ROLLBACK to the COMMIT of a failed transaction
                raise RuntimeError(f"the batch's transaction did not commit ({status})")
        if workers is not None and self.worker_fold is not None:
            self.worker_fold.committed(workers)
        self.checkpoint = batch.last_seq
        self.malformed += len(malformed)
        self.dead_letters += len(malformed)
        self.states.update(batch.rollouts)
        self.rollout_seq.update(batch.rollout_seq)
        self.workers.update(batch.workers)
        for rid in batch.terminal:  # finished rollouts are reloaded from Postgres if touched again,
            if rid in self.states and watched(self.states[rid]):
                continue  # an attempt still live (a late span revived it): the watchdog watches it
            self.states.pop(rid, None)  # so memory follows the rollouts in flight, not all rollouts
            self.rollout_seq.pop(rid, None)
        if self.on_commit is not None:
            self.on_commit(self.checkpoint, batch.terminal)

    def _classify(self, seq: int, msg: Any) -> tuple[bool, Item | None]:
        """Whether a message is this partition's to fold, and its ``Item`` for partition 0's
        worker side (``None``: not needed). Reads only the subject; decodes another partition's
        rollout state event (``r.*``) for partition 0, never its spans (``s.*``)."""
        if self.partitions == 1:
            return True, None
        tokens = msg.subject.split(".", 4)
        kind = tokens[2] if len(tokens) > 3 else ""
        own = (partition_of(tokens[3], self.partitions) if kind in ("r", "s") else 0) == self.partition
        if self.worker_fold is None or kind not in ("r", "s", "w"):
            return own, None
        attempt_id = tokens[4] if kind == "s" and len(tokens) > 4 else None
        event: AnyEvent | None = None
        if not own and kind == "r":
            try:
                event = decode_for_projection(msg.data)
            except InvalidInputError:
                return own, None  # its own partition dead-letters it
        return own, Item(seq, kind, attempt_id, msg.data, event)

    async def _fold_workers(self, conn: asyncpg.Connection, batch: Changes, items: list[Item]) -> WorkerChanges | None:
        """In a partitioned projection, the batch's worker records are partition 0's worker fold
        (``workers``), and no other partition's."""
        if self.partitions == 1:
            return None
        batch.workers, batch.worker_created_seq = {}, {}
        if self.worker_fold is None or not items:
            return None
        fetched = await self.worker_fold.prefetch(conn, items, self.workers)
        known: ChainMap[str, Worker | None] = ChainMap(fetched, self.workers)  # type: ignore[arg-type]
        changes = self.worker_fold.fold(items, known)
        batch.workers, batch.worker_created_seq = changes.workers, changes.created_seq
        return changes

    async def _fold(self, conn: asyncpg.Connection, events: list[tuple[int, AnyEvent]]) -> Changes:
        """The fold of ``events``. The rollouts and workers it touches that are not cached are read
        from Postgres first, in one query each (a rebuild or a restarted projector caches nothing);
        one the prefetch could not name (a worker known only from its attempt) is read when the
        fold asks for it and the batch folded again (the fold is pure, so a second round gives what
        one would have). Each round reads a new key, so the rounds end."""
        rollouts, workers = await self._prefetch(conn, events)

        def rollout(rid: str) -> RolloutState | None:
            if rid in self.states:
                return self.states[rid]
            if rid in rollouts:
                return rollouts[rid]
            raise Missing("rollout", rid)

        def worker(wid: str) -> Worker | None:
            if self.partitions > 1:
                return None  # partitioned: the worker records are partition 0's worker fold
            if wid in self.workers:
                return self.workers[wid]
            if wid in workers:
                return workers[wid]
            raise Missing("worker", wid)

        while True:
            try:
                return fold_batch(events, rollout, worker)
            except Missing as m:
                if m.kind == "rollout":
                    if m.key in rollouts:
                        raise RuntimeError(f"the fold asked again for rollout {m.key}, already read") from m
                    rollouts[m.key] = await self._load_rollout(conn, m.key)
                else:
                    if m.key in workers:
                        raise RuntimeError(f"the fold asked again for worker {m.key}, already read") from m
                    workers[m.key] = await self._load_worker(conn, m.key)

    async def _prefetch(
        self, conn: asyncpg.Connection, events: list[tuple[int, AnyEvent]]
    ) -> tuple[dict[str, RolloutState | None], dict[str, Worker | None]]:
        """The rollouts and workers ``events`` name that are neither cached nor created in the
        batch, read in one query each (``None``: not in the read model)."""
        created: set[str] = set()
        wanted: set[str] = set()
        for _, event in events:
            rid = rollout_id_of(event)
            if rid is None:
                continue
            if isinstance(event, RolloutCreated):
                created.add(rid)
            elif rid not in self.states and rid not in created:
                wanted.add(rid)
        rollouts = await self._load_rollouts(conn, sorted(wanted)) if wanted else {}
        workers: dict[str, Worker | None] = {}
        if self.partitions == 1:
            wids = sorted({w for w in worker_ids_of(e for _, e in events) if w not in self.workers})
            if wids:
                workers = dict.fromkeys(wids)
                for row in await conn.fetch(f"SELECT {WORKER_COLS} FROM workers WHERE worker_id = ANY($1)", wids):
                    w = worker_from_row(row)
                    workers[w.worker_id] = w
        return rollouts, workers

    async def _load_rollouts(self, conn: asyncpg.Connection, rids: list[str]) -> dict[str, RolloutState | None]:
        """``_load_rollout`` for many ids, in two queries."""
        rows = await conn.fetch(f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE rollout_id = ANY($1)", rids)
        attempts: dict[str, list[Any]] = {}
        for a in await conn.fetch(
            f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = ANY($1) ORDER BY rollout_id, sequence_id", rids
        ):
            attempt = attempt_from_row(a)
            attempts.setdefault(attempt.rollout_id, []).append(attempt)
        out: dict[str, RolloutState | None] = dict.fromkeys(rids)
        for row in rows:
            r = rollout_from_row(row)
            self.rollout_seq.setdefault(r.rollout_id, row[9])
            out[r.rollout_id] = RolloutState(rollout=r, attempts=tuple(attempts.get(r.rollout_id, ())))
        return out

    async def _load_rollout(self, conn: asyncpg.Connection, rid: str) -> RolloutState | None:
        return (await self._load_rollouts(conn, [rid]))[rid]

    async def _load_worker(self, conn: asyncpg.Connection, wid: str) -> Worker | None:
        row = await conn.fetchrow(f"SELECT {WORKER_COLS} FROM workers WHERE worker_id = $1", wid)
        return worker_from_row(row) if row else None

    async def _write(self, conn: asyncpg.Connection, b: Changes) -> None:
        if b.spans:
            await self._write_spans(conn, [span_row(s, seq) for s, seq in b.spans], b.last_seq)
        if b.rollouts:
            # by rollout_id (byte order), as `retire` locks rollouts it marks retired: no deadlock with it
            states = [state for _, state in sorted(b.rollouts.items())]
            attempts = [a for s in states for a in s.attempts]
            await conn.executemany(UPSERT_ATTEMPT, [attempt_row(a) for a in attempts])
            if self.partitions > 1:  # the status counts' rows (a trigger's), locked in one order: no deadlock
                await conn.execute("SELECT 1 FROM rollout_status_counts ORDER BY status FOR UPDATE")
            await conn.executemany(UPSERT_ROLLOUT, [rollout_row(s, b, self.rollout_seq) for s in states])
        if b.resources:
            await conn.executemany(
                UPSERT_RESOURCES, [resources_row(r, first, last) for r, first, last in b.resources.values()]
            )
        if b.workers:
            rows = [worker_row(w, b.worker_created_seq.get(wid)) for wid, w in b.workers.items()]
            await conn.executemany(UPSERT_WORKER, rows)

    async def _write_spans(self, conn: asyncpg.Connection, rows: list[tuple[Any, ...]], last_seq: int) -> None:
        """Insert the batch's span rows (``span_row``s) with one ``COPY``, after the savepoint that
        opened the batch's transaction with its checkpoint (``_advance``). A span already in the
        read model (published again, or twice in the batch) makes the copy fail on the primary key;
        the transaction is rolled back to the savepoint, the checkpoint moved to ``last_seq`` again
        (fenced again: the savepoint's rollback gave its row lock back) and the rows go row by row
        with ``ON CONFLICT DO NOTHING`` instead, so the first copy of a span stays, as the in-memory
        backend keeps it. Either way the rows commit with the checkpoint.

        Raises:
            Deposed: Another projector took the lead while the copy was rolled back.
            asyncpg.PostgresError: Postgres refused a row for another reason (the caller isolates it).
        """
        try:
            await conn.copy_records_to_table("spans", records=rows, columns=SPAN_COLUMNS)
        except asyncpg.UniqueViolationError:
            log.debug("projector: %d span rows meet rows already projected; inserting them one by one", len(rows))
            await conn.execute("ROLLBACK TO SAVEPOINT spans")  # the batch's transaction is usable again
            await self._advance(conn, last_seq)
            await conn.executemany(INSERT_SPAN, rows)


async def _roll_back(conn: asyncpg.Connection, *, cut: bool = False, stuck: bool = False) -> None:
    """End a batch's failed transaction, if one is open (the caller raises what failed it). A
    connection that cannot roll back is closed, and the pool opens another: none goes back to the
    pool in a transaction.

    ``cut``: a cancellation (a ``BaseException`` that is not an ``Exception``) ended the batch,
    perhaps inside a query. ``ROLLBACK`` is then sent whatever ``is_in_transaction()`` says: the
    cut query may be the one that opens the transaction (``_advance``), which asyncpg learns of
    only from its answer. asyncpg sends it once the server has cancelled the cut query (closing
    the connection instead would leave that query running on the server, and a cut ``UPDATE``
    holding its rows). Given back as it was, the pool's reset rolled it back, reported as
    "Resetting connection with an active transaction" through the event loop's exception handler.

    ``stuck``: asyncpg refused a query because the connection's protocol is in a state no query can
    follow (``InternalClientError``: its server ended it, and asyncpg has not seen it close yet):
    it is closed, so that the pool does not hand it out again.

    A connection that was lost may already be back in the pool (asyncpg gives it back as it sees it
    close): nothing is left to do, and what failed the batch is what the caller raises."""
    try:
        if conn.is_closed():
            return
    except asyncpg.InterfaceError:  # "connection has been released back to the pool": it was lost
        return
    if stuck:
        conn.terminate()
        return
    if not cut and not conn.is_in_transaction():
        return
    try:
        await conn.execute("ROLLBACK")  # with none open: a warning from the server, no error
    except Exception as e:
        log.debug("projector: closing a connection that could not roll a batch back: %r", e)
        conn.terminate()
    except BaseException:
        conn.terminate()
        raise
