"""The in-memory read model: dicts fed by the projector's fold (``eventlight.store.fold``).

Each event the in-memory log appends is folded at once (a batch of one, its position the
checkpoint), so reads see writes immediately. Queries filter, sort and page in Python with the
same rules as the SQL read model (``eventlight.store.query``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Literal

from eventlight.core.commands import RolloutState
from eventlight.core.errors import RolloutNotFoundError
from eventlight.core.events import AnyEvent
from eventlight.core.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    Span,
    Worker,
)
from eventlight.store import query as q
from eventlight.store.fold import Changes, fold_batch, in_flight
from eventlight.store.memory.signal import Signal


class MemoryReadModel:
    """Rollouts, spans, resources and workers as the fold of the log, plus the queries."""

    def __init__(self) -> None:
        self.rollouts: dict[str, RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.spans: dict[str, list[Span]] = {}
        self._span_keys: set[tuple[str, str, str]] = set()
        self.resources: dict[str, ResourcesUpdate] = {}
        self.workers: dict[str, Worker] = {}
        self.checkpoint = 0
        self._changed = Signal()

    # -- projection ------------------------------------------------------------------------

    def apply(self, batch: list[tuple[int, AnyEvent]]) -> None:
        """Fold a batch and commit its changes and checkpoint at once (nothing can interleave)."""
        batch = [(seq, e) for seq, e in batch if seq > self.checkpoint]
        if not batch:
            return
        self._commit(fold_batch(batch, self.rollouts.get, self.workers.get))

    def on_event(self, seq: int, event: AnyEvent) -> None:
        """The log's subscriber: project one event."""
        self.apply([(seq, event)])

    def _commit(self, b: Changes) -> None:
        self.rollouts.update(b.rollouts)
        self.rollout_seq.update(b.rollout_seq)
        for span, _ in b.spans:
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key not in self._span_keys:
                self._span_keys.add(key)
                self.spans.setdefault(span.rollout_id, []).append(span)
        for res_id, (snap, _, _) in b.resources.items():
            self.resources.setdefault(res_id, snap)
            self.resources[res_id] = snap
        self.workers.update(b.workers)
        self.checkpoint = b.last_seq
        self._changed.set()
        self._changed = Signal()

    def in_flight(self) -> list[tuple[str, RolloutState, int]]:
        """``(rollout_id, state, version)`` of the rollouts the watchdog watches."""
        return [(rid, self.rollouts[rid], self.rollout_seq.get(rid, 0)) for rid in in_flight(self.rollouts)]

    async def sync(self, seq: int) -> None:
        """Nothing to wait for: the projection is synchronous."""

    async def close(self) -> None:
        """Nothing to release."""

    def _state(self, rollout_id: str) -> RolloutState:
        state = self.rollouts.get(rollout_id)
        if state is None:
            raise RolloutNotFoundError(rollout_id)
        return state

    # -- queries ---------------------------------------------------------------------------

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout]:
        status_in = q.deprecated_alias(status_in, status, "status_in", "status")
        rollout_id_in = q.deprecated_alias(rollout_id_in, rollout_ids, "rollout_id_in", "rollout_ids")
        q.check_paging(limit, offset, sort_order, filter_logic)
        q.check_sort_field(Rollout, sort_by)
        items = [s.attempted() for s in self.rollouts.values()]
        conds = [
            q.within("status", status_in),
            q.within("rollout_id", rollout_id_in),
            q.contains("rollout_id", rollout_id_contains),
        ]
        return q.select(
            items, conds, filter_logic=filter_logic, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
        )

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        state = self.rollouts.get(rollout_id)
        return state.attempted() if state is not None else None

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        q.check_paging(limit, offset, sort_order)
        q.check_sort_field(Attempt, sort_by)
        state = self._state(rollout_id)
        return q.select(state.attempts, [], sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        return self._state(rollout_id).latest

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None) -> list[Rollout]:
        for rid in rollout_ids:
            self._state(rid)

        def finished() -> list[Rollout]:
            return [
                self.rollouts[rid].attempted()
                for rid in rollout_ids
                if self.rollouts[rid].rollout.status in TERMINAL_ROLLOUT_STATUSES
            ]

        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        while True:
            done = finished()
            if len(done) == len(rollout_ids) or (deadline is not None and loop.time() >= deadline):
                return done
            wait = None if deadline is None else deadline - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]:
        q.check_paging(limit, offset, sort_order, filter_logic)
        q.check_sort_field(Span, sort_by)
        state = self._state(rollout_id)
        spans = self.spans.get(rollout_id, [])
        if attempt_id is not None:
            if attempt_id == "latest" and not state.attempts:
                return PaginatedResult([], limit=limit, offset=offset, total=0)
            aid = state.attempt(attempt_id).attempt_id
            spans = [s for s in spans if s.attempt_id == aid]
        elif sort_by == "sequence_id" and len(state.attempts) > 1:  # attempts in order, as 0.3.0's per-rollout ids
            rank = {a.attempt_id: a.sequence_id for a in state.attempts}
            spans = sorted(spans, key=lambda s: (rank[s.attempt_id], s.sequence_id), reverse=sort_order == "desc")
            sort_by = None  # sorted (stable: equal keys keep log order, as Postgres' stream_seq)
        conds = [
            q.exact("trace_id", trace_id),
            q.contains("trace_id", trace_id_contains),
            q.exact("span_id", span_id),
            q.contains("span_id", span_id_contains),
            q.exact("parent_id", parent_id),
            q.contains("parent_id", parent_id_contains),
            q.exact("name", name),
            q.contains("name", name_contains),
        ]
        return q.select(
            spans, conds, filter_logic=filter_logic, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
        )

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        q.check_paging(limit, offset, sort_order)
        q.check_sort_field(ResourcesUpdate, sort_by)
        conds = [q.exact("resources_id", resources_id), q.contains("resources_id", resources_id_contains)]
        items = list(self.resources.values())
        return q.select(items, conds, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset)

    async def query_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        worker_id_in: Sequence[str] | None = None,
    ) -> PaginatedResult[Worker]:
        q.check_paging(limit, offset, sort_order, filter_logic)
        q.check_sort_field(Worker, sort_by)
        items = list(self.workers.values())
        if worker_id_in is not None:
            wanted = set(worker_id_in)
            items = [w for w in items if w.worker_id in wanted]
        conds = [q.within("status", status_in), q.contains("worker_id", worker_id_contains)]
        return q.select(
            items, conds, filter_logic=filter_logic, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
        )

    async def statistics(self) -> dict[str, Any]:
        return {
            "total_rollouts": len(self.rollouts),
            "total_attempts": sum(len(s.attempts) for s in self.rollouts.values()),
            "total_spans": sum(len(s) for s in self.spans.values()),
            "total_resources": len(self.resources),
            "total_workers": len(self.workers),
        }
