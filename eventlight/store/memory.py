"""``InMemoryLightningStore``: the same decider and API as the JetStream backend, in one process.

For tests and quick local work. Every write goes through ``decider.decide`` and is applied with
``decider.evolve`` (exactly what the projector does with stream events), so the two backends follow
one rule book. Not shared across processes; ``capabilities`` says so.

The watchdog (``CheckHealth``) runs when ``run_watchdog(now)`` is called, and every
``watchdog_interval_s`` seconds in a background task while the store is used inside
``async with`` (``start()``/``close()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from eventlight import decider as d
from eventlight.errors import InvalidInputError, ResourcesNotFoundError, RolloutNotFoundError
from eventlight.events import (
    AnyEvent,
    SpansAdded,
    WorkerHeartbeat,
    WorkerIdle,
    enters_queue,
    rollout_id_of,
)
from eventlight.store import query as q
from eventlight.store.base import UNSET, LightningStore, LightningStoreCapabilities
from eventlight.store.validate import check_resources, check_spans, check_stats, check_token
from eventlight.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    AttemptedRollout,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Worker,
    generate_id,
)
from eventlight.types import now as wall_clock

log = logging.getLogger(__name__)


class InMemoryLightningStore(LightningStore):
    """An in-process store.

    Args:
        clock: Returns the current time in seconds; injectable for tests of timing rules.
        watchdog_interval_s: How often the background watchdog checks running attempts.
    """

    def __init__(self, *, clock: Callable[[], float] = wall_clock, watchdog_interval_s: float = 1.0):
        self._clock = clock
        self._watchdog_interval_s = watchdog_interval_s
        self._rollouts: dict[str, d.RolloutState] = {}
        self._queue: deque[str] = deque()
        self._spans: dict[str, list[Span]] = {}
        self._span_keys: set[tuple[str, str, str]] = set()
        self._seq: dict[tuple[str, str], int] = {}
        self._resources: dict[str, ResourcesUpdate] = {}
        self._latest_resources: str | None = None
        self._workers: dict[str, Worker] = {}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": False, "otlp_traces": False}

    async def start(self) -> InMemoryLightningStore:
        """Start the background watchdog."""
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watchdog_loop(), name="eventlight-watchdog")
        return self

    async def __aenter__(self) -> InMemoryLightningStore:
        return await self.start()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None

    async def statistics(self) -> dict[str, Any]:
        return {
            "name": type(self).__name__,
            "total_rollouts": len(self._rollouts),
            "total_attempts": sum(len(s.attempts) for s in self._rollouts.values()),
            "total_spans": sum(len(s) for s in self._spans.values()),
            "total_resources": len(self._resources),
            "total_workers": len(self._workers),
        }

    # -- applying events ------------------------------------------------------------------

    def _state(self, rollout_id: str) -> d.RolloutState:
        state = self._rollouts.get(rollout_id)
        if state is None:
            raise RolloutNotFoundError(rollout_id)
        return state

    def _apply(self, events: Sequence[AnyEvent]) -> None:
        for event in events:
            rid = rollout_id_of(event)
            if rid is not None:
                new = d.evolve(self._rollouts.get(rid), event)
                if new is not None:
                    self._rollouts[rid] = new
                if enters_queue(event):
                    self._queue.append(rid)
            for wid in d.workers_of(event):
                w = d.evolve_worker(self._workers.get(wid), event, wid)
                if w is not None:
                    self._workers[wid] = w

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _execute(self, rollout_id: str, command: d.Command) -> list[AnyEvent]:
        async with self._lock:
            events: list[AnyEvent] = list(d.decide(self._state(rollout_id), command, self._clock()))
            self._apply(events)
        await self._notify()
        return events

    def _resolve_resources(self, resources_id: str | None) -> str | None:
        if resources_id is None:
            return self._latest_resources
        if resources_id not in self._resources:
            raise ResourcesNotFoundError(resources_id)
        return resources_id

    # -- rollouts ---------------------------------------------------------------------------

    async def _create(self, cmd: d.CreateRollout) -> d.RolloutState:
        async with self._lock:
            cmd = msgspec.structs.replace(cmd, resources_id=self._resolve_resources(cmd.resources_id))
            self._apply(d.decide(None, cmd, self._clock()))
            state = self._rollouts[cmd.rollout_id]
        await self._notify()
        return state

    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        cmd = d.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=resources_id,
            config=config,
            metadata=metadata,
        )
        return (await self._create(cmd)).rollout

    async def start_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        cmd = d.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=resources_id,
            config=config,
            metadata=metadata,
            queued=False,
            attempt_id=generate_id("at-", 8),
            worker_id=worker_id,
        )
        return (await self._create(cmd)).attempted()  # type: ignore[return-value]

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        async with self._lock:
            claimed: AttemptedRollout | None = None
            while self._queue:
                rid = self._queue.popleft()
                state = self._rollouts[rid]
                if not d.is_claimable(state):
                    continue  # cancelled or revived since it was queued
                cmd = d.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id, claim=True)
                self._apply(d.decide(state, cmd, self._clock()))
                claimed = self._rollouts[rid].attempted()  # type: ignore[assignment]
                break
            if claimed is None and worker_id is not None:
                self._apply([WorkerIdle(time=self._clock(), worker_id=worker_id)])
        await self._notify()
        return claimed

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        await self._execute(rollout_id, d.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id))
        return self._rollouts[rollout_id].attempted()  # type: ignore[return-value]

    async def update_rollout(
        self,
        rollout_id: str,
        input: Any = UNSET,
        mode: Any = UNSET,
        resources_id: Any = UNSET,
        status: Any = UNSET,
        config: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Rollout:
        if resources_id is not UNSET and resources_id is not None and resources_id not in self._resources:
            raise ResourcesNotFoundError(resources_id)
        cmd = d.UpdateRollout(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        await self._execute(rollout_id, cmd)
        return self._rollouts[rollout_id].rollout

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: Any = UNSET,
        worker_id: Any = UNSET,
        last_heartbeat_time: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Attempt:
        state = self._state(rollout_id)
        attempt_id = state.attempt(attempt_id).attempt_id
        cmd = d.UpdateAttempt(
            attempt_id=attempt_id,
            status=status,
            worker_id=worker_id,
            last_heartbeat_time=last_heartbeat_time,
            metadata=metadata,
        )
        await self._execute(rollout_id, cmd)
        return self._rollouts[rollout_id].attempt(attempt_id)

    async def run_watchdog(self, now: float | None = None) -> list[AnyEvent]:
        """Check every running rollout once; return the ``timeout``/``unresponsive`` events it recorded."""
        at = self._clock() if now is None else now
        events: list[AnyEvent] = []
        async with self._lock:
            for state in list(self._rollouts.values()):
                found = d.decide(state, d.CheckHealth(), at)
                self._apply(found)
                events.extend(found)
        if events:
            await self._notify()
        return events

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(self._watchdog_interval_s)
            try:
                await self.run_watchdog()
            except Exception:  # pragma: no cover - logged, loop continues
                log.exception("watchdog pass failed")

    # -- reads ------------------------------------------------------------------------------

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
        items = [s.attempted() for s in self._rollouts.values()]
        conds = [
            q.within("status", status_in),
            q.within("rollout_id", rollout_id_in),
            q.contains("rollout_id", rollout_id_contains),
        ]
        return q.select(
            items,
            conds,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        state = self._rollouts.get(rollout_id)
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

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        for rid in rollout_ids:
            self._state(rid)

        def finished() -> list[Rollout]:
            return [
                self._rollouts[rid].attempted()
                for rid in rollout_ids
                if self._rollouts[rid].rollout.status in TERMINAL_ROLLOUT_STATUSES
            ]

        if timeout is not None and timeout <= 0:
            return finished()
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: len(finished()) == len(rollout_ids)), timeout)
        return finished()

    # -- spans ------------------------------------------------------------------------------

    def _check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        self._state(rollout_id).attempt(attempt_id)

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        check_spans(spans)
        for span in spans:
            self._check_attempt(span.rollout_id, span.attempt_id)
        added: list[Span] = []
        async with self._lock:
            groups: dict[tuple[str, str], list[Span]] = {}
            for span in spans:
                key = (span.rollout_id, span.attempt_id, span.span_id)
                if key in self._span_keys:
                    continue
                self._span_keys.add(key)
                groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
                added.append(span)
            for (rid, aid), group in groups.items():
                self._spans.setdefault(rid, []).extend(group)
                top = max(s.sequence_id for s in group)
                self._seq[(rid, aid)] = max(self._seq.get((rid, aid), 0), top)
                self._apply([SpansAdded(time=self._clock(), rollout_id=rid, attempt_id=aid, spans=group)])
        await self._notify()
        return added

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        resolved = [(rid, self._state(rid).attempt(aid).attempt_id) for rid, aid in rollout_attempt_ids]
        out: list[int] = []
        for rid, aid in resolved:
            nxt = self._seq.get((rid, aid), 0) + 1
            self._seq[(rid, aid)] = nxt
            out.append(nxt)
        return out

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
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
        spans = self._spans.get(rollout_id, [])
        if attempt_id is not None:
            if attempt_id == "latest" and not state.attempts:
                return PaginatedResult([], limit=limit, offset=offset, total=0)
            aid = state.attempt(attempt_id).attempt_id
            spans = [s for s in spans if s.attempt_id == aid]
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
            spans,
            conds,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )

    # -- resources --------------------------------------------------------------------------

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return await self.put_resources(generate_id("rs-", 12), resources, create_only=True)

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        if resources_id not in self._resources:
            raise ResourcesNotFoundError(resources_id)
        return await self.put_resources(resources_id, resources)

    async def put_resources(
        self, resources_id: str, resources: NamedResources, *, create_only: bool = False
    ) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        check_resources(resources)
        async with self._lock:
            at = self._clock()
            old = self._resources.get(resources_id)
            if old is not None and create_only:
                raise InvalidInputError(f"resources {resources_id!r} already exist")
            snap = ResourcesUpdate(
                resources_id=resources_id,
                create_time=old.create_time if old else at,
                update_time=at,
                version=old.version + 1 if old else 1,
                resources=dict(resources),
            )
            self._resources.pop(resources_id, None)
            self._resources[resources_id] = snap
            self._latest_resources = resources_id
        return snap

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        return self._resources.get(resources_id)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return self._resources.get(self._latest_resources) if self._latest_resources else None

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
        items = sorted(self._resources.values(), key=lambda r: r.create_time)
        conds = [q.exact("resources_id", resources_id), q.contains("resources_id", resources_id_contains)]
        return q.select(items, conds, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset)

    # -- workers ----------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        check_token("worker_id", worker_id)
        stats = None if heartbeat_stats is UNSET else check_stats(heartbeat_stats)
        async with self._lock:
            self._apply([WorkerHeartbeat(time=self._clock(), worker_id=worker_id, heartbeat_stats=stats)])
        return self._workers[worker_id]

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

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
    ) -> PaginatedResult[Worker]:
        q.check_paging(limit, offset, sort_order, filter_logic)
        q.check_sort_field(Worker, sort_by)
        conds = [q.within("status", status_in), q.contains("worker_id", worker_id_contains)]
        return q.select(
            list(self._workers.values()),
            conds,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )
