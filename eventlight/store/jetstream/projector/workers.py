"""Partition 0's worker records in a partitioned projection: the worker side of every event, in log order.

A worker's record (``evolve_worker``) follows its heartbeats and empty polls (partition 0's ``w.*``
subjects) *and* the attempts it runs (``AttemptStarted``/``AttemptUpdated`` of any partition's
rollouts, with the attempt's status and worker after the event). So in a partitioned projection
partition 0 decodes every rollout's state events (``r.*``: a few per attempt, not the spans), keeps
each attempt's ``(worker_id, status)`` in ``projector_attempt_workers`` (written in its own
transactions, so it is as of partition 0's checkpoint after any restart) and folds the same
``workers_of``/``evolve_worker`` as the one-partition fold (``eventlight.store.fold``), in the same
order. A span batch changes no worker, except through the attempt's status: it revives an
``unresponsive`` attempt to ``running`` (``spans_arrived``), the one status change that moves an
attempt between the two sides ``evolve_worker`` tells apart, so only the span messages of
attempts that are ``unresponsive`` at that point of the log are decoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import asyncpg
import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.core.events import AnyEvent, AttemptStarted, AttemptUpdated, SpansAdded, WorkerHeartbeat, WorkerIdle
from eventlight.core.evolve import evolve_worker, workers_of
from eventlight.core.types import Attempt, Worker
from eventlight.store.jetstream.pg import WORKER_COLS, worker_from_row
from eventlight.store.jetstream.rows import decode_for_projection

MAX_CACHED = 100_000
"""Attempts whose worker and status are kept in memory between batches (beyond: read again)."""


class AttemptWorker(NamedTuple):
    worker_id: str | None
    status: str


class Item(NamedTuple):
    """One message of partition 0's batch, in log order: ``event`` decoded, or ``None`` when not
    (yet): a span message of another partition's rollout, decoded only when it matters."""

    seq: int
    kind: str
    attempt_id: str | None
    data: bytes
    event: AnyEvent | None


class WorkerChanges(msgspec.Struct):
    workers: dict[str, Worker] = msgspec.field(default_factory=dict)
    created_seq: dict[str, int] = msgspec.field(default_factory=dict)
    attempts: dict[str, AttemptWorker] = msgspec.field(default_factory=dict)
    unresponsive: set[str] = msgspec.field(default_factory=set)


def _attempt(rollout_id: str, attempt_id: str, a: AttemptWorker) -> Attempt:
    """What ``evolve_worker`` reads of an attempt (its ids, worker and status)."""
    return Attempt(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=0,
        start_time=0.0,
        status=a.status,  # type: ignore[arg-type]
        worker_id=a.worker_id,
    )


class WorkerFold:
    """Partition 0's worker side: a cache of attempts' ``(worker_id, status)`` and of the
    ``unresponsive`` ones, read from ``projector_attempt_workers`` when a term starts."""

    def __init__(self) -> None:
        self.attempts: dict[str, AttemptWorker | None] = {}
        self.unresponsive: set[str] = set()

    async def start_term(self, conn: asyncpg.Connection) -> None:
        """Forget what an earlier term cached and read the attempts that are ``unresponsive``."""
        rows = await conn.fetch(
            "SELECT attempt_id, worker_id, status FROM projector_attempt_workers WHERE status = 'unresponsive'"
        )
        self.attempts = {r[0]: AttemptWorker(r[1], r[2]) for r in rows}
        self.unresponsive = set(self.attempts)

    async def prefetch(
        self, conn: asyncpg.Connection, items: list[Item], workers: dict[str, Worker]
    ) -> dict[str, Worker | None]:
        """Read the attempts and workers the batch may touch that are not cached; returns the
        workers read (``None``: not in the table yet)."""
        missing = sorted(
            {i.event.attempt_id for i in items if isinstance(i.event, AttemptUpdated)} - self.attempts.keys()
        )
        if missing:
            rows = await conn.fetch(
                "SELECT attempt_id, worker_id, status FROM projector_attempt_workers WHERE attempt_id = ANY($1)",
                missing,
            )
            found = {r[0]: AttemptWorker(r[1], r[2]) for r in rows}
            self.attempts.update({aid: found.get(aid) for aid in missing})
        wids = set(worker_ids_of(i.event for i in items))
        for i in items:
            if isinstance(i.event, AttemptUpdated) and (a := self.attempts.get(i.event.attempt_id)) and a.worker_id:
                wids.add(a.worker_id)
        wanted = sorted(w for w in wids if w not in workers)
        rows = []
        if wanted:
            rows = await conn.fetch(f"SELECT {WORKER_COLS} FROM workers WHERE worker_id = ANY($1)", wanted)
        got: dict[str, Worker | None] = dict.fromkeys(wanted)
        for r in rows:
            w = worker_from_row(r)
            got[w.worker_id] = w
        return got

    def fold(self, items: list[Item], workers: Mapping[str, Worker | None]) -> WorkerChanges:
        """The worker changes of a batch (after ``prefetch``); nothing cached is changed until
        ``committed``."""
        out = WorkerChanges(unresponsive=set(self.unresponsive))

        def attempt(aid: str) -> AttemptWorker | None:
            return out.attempts[aid] if aid in out.attempts else self.attempts.get(aid)

        for item in items:
            event = item.event
            if event is None and item.kind == "s" and item.attempt_id in out.unresponsive:
                try:
                    event = decode_for_projection(item.data)
                except InvalidInputError:
                    continue  # its partition dead-letters it
            if isinstance(event, SpansAdded):
                a = attempt(event.attempt_id)
                if event.spans and a is not None and a.status in ("preparing", "unresponsive"):
                    out.attempts[event.attempt_id] = a._replace(status="running")
                    out.unresponsive.discard(event.attempt_id)
                continue
            if event is None:
                continue
            _fold_one(out, item.seq, event, attempt, workers)
        return out

    def committed(self, changes: WorkerChanges) -> None:
        """Keep what a committed batch changed."""
        if len(self.attempts) > MAX_CACHED:
            self.attempts = {aid: self.attempts[aid] for aid in self.unresponsive if aid in self.attempts}
        self.attempts.update(changes.attempts)
        self.unresponsive = changes.unresponsive


def worker_ids_of(events: Iterable[AnyEvent | None]) -> Iterable[str]:
    for e in events:
        if isinstance(e, (WorkerHeartbeat, WorkerIdle)):
            yield e.worker_id
        elif isinstance(e, AttemptStarted) and e.attempt.worker_id:
            yield e.attempt.worker_id
        elif isinstance(e, AttemptUpdated) and isinstance(e.worker_id, str):
            yield e.worker_id


def _fold_one(
    out: WorkerChanges, seq: int, event: AnyEvent, attempt: Any, workers: Mapping[str, Worker | None]
) -> None:
    """One event's worker side, as ``fold_event`` folds it (``updated_attempt`` is the attempt after it)."""
    after: Attempt | None = None
    if isinstance(event, AttemptStarted):
        a = AttemptWorker(event.attempt.worker_id, event.attempt.status)
        out.attempts[event.attempt.attempt_id] = a
        _track(out, event.attempt.attempt_id, a)
    elif isinstance(event, AttemptUpdated):
        old = attempt(event.attempt_id)
        if old is None:
            return  # an attempt its rollout does not have: no worker changes
        a = AttemptWorker(
            old.worker_id if isinstance(event.worker_id, msgspec.UnsetType) else event.worker_id,
            old.status if isinstance(event.status, msgspec.UnsetType) else event.status,
        )
        out.attempts[event.attempt_id] = a
        _track(out, event.attempt_id, a)
        after = _attempt(event.rollout_id, event.attempt_id, a)
    for wid in workers_of(event, after):
        current = out.workers[wid] if wid in out.workers else workers.get(wid)
        w = evolve_worker(current, event, wid, after)
        if w is not None:
            if current is None:
                out.created_seq[wid] = seq
            out.workers[wid] = w


def _track(out: WorkerChanges, attempt_id: str, a: AttemptWorker) -> None:
    if a.status == "unresponsive":
        out.unresponsive.add(attempt_id)
    else:
        out.unresponsive.discard(attempt_id)
