"""Applying one batch: the fold, its rows and the checkpoint in one transaction (mixed into ``Projector``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError
from eventlight.core.events import AnyEvent
from eventlight.core.types import Worker
from eventlight.store.fold import Changes, Missing, fold_batch
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.pg import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    WORKER_COLS,
    attempt_from_row,
    rollout_from_row,
    worker_from_row,
)
from eventlight.store.jetstream.projector.common import MAX_FOLD_ROUNDS, Deposed
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

log = logging.getLogger(__name__)


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
