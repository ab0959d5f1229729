"""``EventStore``: the one ``LightningStore``, written once over the two ports (``ports``).

Every rule that is not a pure transition lives here, for every backend: the command loop
(``command_loop``), claims from the work queue, resources versioning, ``resources_id=None`` → the
latest snapshot, ``attempt_id="latest"``, validation of ids and spans, the worker idle/busy policy
and span de-duplication. A backend only says how to build its ``EventLog`` and ``ReadModel``
(``eventlight.store.memory``, ``eventlight.store.jetstream``).

Policies (the same on every backend):
    * ``worker_id`` values become subject tokens: one with dots, spaces or wildcards is refused with
      ``InvalidInputError`` by ``dequeue_rollout``, ``start_rollout``, ``start_attempt`` and
      ``update_worker``;
    * an empty poll marks a worker ``idle`` (a ``WorkerIdle`` event, which sets
      ``last_dequeue_time`` and ``idle``): at once after the worker claimed or started an attempt
      through this store, else at most once per ``IDLE_REFRESH_S`` (1 s), so ``last_dequeue_time``
      is the worker's last poll to within a second (0.3.0 writes it on every poll; here each write
      is an fsynced event, and a spinning poller would write hundreds a second);
    * a claim keeps its queue entry in progress (``update_worker`` extends it) until the attempt
      finishes through this store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from eventlight.core import commands as c
from eventlight.core.errors import (
    ConcurrencyError,
    InvalidInputError,
    InvalidTransitionError,
    NotFoundError,
    ResourcesNotFoundError,
)
from eventlight.core.events import ResourcesPut, WorkerHeartbeat, WorkerIdle
from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    Span,
    Worker,
    generate_id,
)
from eventlight.store.base import LightningStore
from eventlight.store.command_loop import CommandLoop
from eventlight.store.ports import EventLog, Queued, ReadModel
from eventlight.store.spans import SpanWriter
from eventlight.store.validate import (
    check_one_attempt,
    check_payload,
    check_resources,
    check_spans,
    check_stats,
    check_token,
    is_token,
)

log = logging.getLogger(__name__)
UNSET = c.UNSET
Unset = c.Unset
ENDED = ("succeeded", "failed", "timeout", "unresponsive")
IDLE_REFRESH_S = 1.0
"""An empty poll re-marks an idle worker (``last_dequeue_time``) at most this often, in seconds."""
MAX_IDLE_MARKS = 4096  # workers whose last idle mark this store remembers


class EventStore(LightningStore):
    """The store over an event log and (optionally) a read model.

    Args:
        log: The event log (the source of truth).
        reads: The read model; ``None`` for a write-only store (reads raise ``InvalidInputError``).
        clock: Wall-clock seconds (injectable for tests of timing rules).
    """

    def __init__(self, log: EventLog | None, reads: ReadModel | None, clock: Callable[[], float]):
        self._clock = clock
        self._last_write = 0
        self._held: dict[tuple[str, str], Queued] = {}
        self._idle_marks: dict[str, float] = {}  # worker id -> clock of this store's last WorkerIdle
        self._closed = False
        self._event_log: EventLog | None = None
        self._read_model: ReadModel | None = None
        self._commands: CommandLoop | None = None
        self._span_writer: SpanWriter | None = None
        if log is not None:
            self._bind(log, reads)

    def _bind(self, log: EventLog, reads: ReadModel | None) -> None:
        """Attach the ports (a backend that connects in ``start()`` binds them there)."""
        self._event_log = log
        self._read_model = reads
        self._commands = CommandLoop(log, self._clock, self._wrote)
        self._span_writer = SpanWriter(log, self._commands, self._wrote)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError("this store is closed")
        if self._event_log is None:
            raise InvalidInputError("the store is not started; use `async with store:` or `await store.start()`")

    @property
    def _loop(self) -> CommandLoop:
        self._check_open()
        assert self._commands is not None
        return self._commands

    @property
    def _spans(self) -> SpanWriter:
        self._check_open()
        assert self._span_writer is not None
        return self._span_writer

    # -- plumbing ----------------------------------------------------------------------------

    def _wrote(self, seq: int) -> None:
        self._last_write = max(self._last_write, seq)

    def _log(self) -> EventLog:
        self._check_open()
        assert self._event_log is not None
        return self._event_log

    async def _reads(self) -> ReadModel:
        """The read model, synced with this store's last write (read-your-writes)."""
        self._check_open()
        if self._read_model is None:
            raise InvalidInputError("this store was opened without Postgres (pg_dsn=None); it cannot answer queries")
        await self._read_model.sync(self._last_write)
        return self._read_model

    async def close(self) -> None:
        """Close the read model and the log; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._read_model is not None:
            await self._read_model.close()
        if self._event_log is not None:
            await self._event_log.close()

    # -- resources resolution -----------------------------------------------------------------

    async def _resolve_resources(self, resources_id: str | None) -> str | None:
        if resources_id is None:
            latest = await self._log().resources(None)
            return latest.resources_id if latest else None
        check_token("resources_id", resources_id)
        if await self._log().resources(resources_id) is None:
            raise ResourcesNotFoundError(resources_id)
        return resources_id

    # -- rollouts -------------------------------------------------------------------------------

    def _create_command(
        self, input: Any, mode: str | None, resources_id: str | None, config: RolloutConfig | None, metadata: Any
    ) -> c.CreateRollout:
        cmd = c.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=resources_id,
            config=config,
            metadata=metadata,
        )
        check_payload("enqueue_rollout", cmd)
        return cmd

    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        cmd = self._create_command(input, mode, await self._resolve_resources(resources_id), config, metadata)
        return (await self._loop.create(cmd)).rollout

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]:
        """``enqueue_rollout`` for each request, in order; ``resources_id=None`` resolved once."""
        latest: str | None | Unset = UNSET
        cmds = []
        for r in rollouts:
            if r.resources_id is None:
                if latest is UNSET:
                    latest = await self._resolve_resources(None)
                res: str | None = latest if not isinstance(latest, Unset) else None
            else:
                res = await self._resolve_resources(r.resources_id)
            cmds.append(self._create_command(r.input, r.mode, res, r.config, r.metadata))
        states = await asyncio.gather(*(self._loop.create(cmd) for cmd in cmds))
        return [s.rollout for s in states]

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
        cmd = c.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=await self._resolve_resources(resources_id),
            config=config,
            metadata=metadata,
            queued=False,
            attempt_id=generate_id("at-", 8),
            worker_id=worker_id,
        )
        check_payload("start_rollout", cmd)
        started = (await self._loop.create(cmd)).attempted_rollout()
        if worker_id is not None:
            self._idle_marks.pop(worker_id, None)
        return started

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait_s: float = 0.0) -> AttemptedRollout | None:
        """Claim the oldest queued rollout.

        Args:
            worker_id: The claiming runner; becomes the attempt's ``worker_id``.
            wait_s: Seconds to wait for work when the queue is empty (eventlight extension; the
                Agent-lightning API is non-blocking, ``0``). Runners pass their poll interval so
                an idle runner sleeps in the server instead of spinning (peer failure C19).

        Raises:
            InvalidInputError: ``worker_id`` is not a token.
        """
        if worker_id is not None:
            check_token("worker_id", worker_id)
        log = self._log()
        deadline = asyncio.get_running_loop().time() + max(0.0, wait_s)
        while True:
            left = deadline - asyncio.get_running_loop().time()
            item = await log.next_queued(max(0.0, left) if wait_s > 0 else 0.0)
            if item is not None:
                claimed = await self._claim(item, worker_id)
                if claimed is not None:
                    if worker_id is not None:
                        self._idle_marks.pop(worker_id, None)
                    return claimed
            if item is None or (wait_s > 0 and asyncio.get_running_loop().time() >= deadline):
                await self._mark_idle(worker_id)
                return None

    async def _claim(self, item: Queued, worker_id: str | None) -> AttemptedRollout | None:
        """Claim a queue entry: append ``AttemptStarted`` expecting the rollout's version; an entry
        whose rollout left ``queuing``/``requeuing`` since is acknowledged and skipped."""
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id, claim=True)
        hint = (item.created, item.seq) if item.created is not None else None
        try:
            outcome = await self._loop.execute(item.rollout_id, cmd, hint=hint, max_tries=3)
        except InvalidTransitionError:
            await item.ack()  # cancelled, revived or already claimed since it was queued
            return None
        except (NotFoundError, InvalidInputError) as e:  # a queue entry no rollout stands behind
            log.warning("dropping queue entry %d on rollout %r: %s", item.seq, item.rollout_id, e)
            await item.ack()  # else it would come back every ack wait, for ever
            return None
        except ConcurrencyError:
            await item.nak(0.1)
            return None
        self._held[(item.rollout_id, cmd.attempt_id)] = item
        return outcome.state.attempted_rollout()

    async def _mark_idle(self, worker_id: str | None) -> None:
        if worker_id is None:
            return
        now = self._clock()
        last = self._idle_marks.get(worker_id)
        if last is not None and 0.0 <= now - last < IDLE_REFRESH_S:
            return
        if len(self._idle_marks) >= MAX_IDLE_MARKS:
            self._idle_marks.pop(next(iter(self._idle_marks)))
        self._idle_marks[worker_id] = now
        self._wrote(await self._log().publish(WorkerIdle(time=now, worker_id=worker_id)))

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id)
        started = (await self._loop.execute(rollout_id, cmd)).state.attempted_rollout()
        if worker_id is not None:
            self._idle_marks.pop(worker_id, None)  # busy now: its next empty poll marks it idle at once
        return started

    async def update_rollout(
        self,
        rollout_id: str,
        input: Any | Unset = UNSET,
        mode: str | None | Unset = UNSET,
        resources_id: str | None | Unset = UNSET,
        status: RolloutStatus | Unset = UNSET,
        config: RolloutConfig | Unset = UNSET,
        metadata: dict[str, Any] | None | Unset = UNSET,
    ) -> Rollout:
        cmd = c.UpdateRollout(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        check_payload("update_rollout", msgspec.structs.replace(cmd, status=UNSET))  # the decider names statuses
        if isinstance(resources_id, str) and not await self._resources_exist(resources_id):
            raise ResourcesNotFoundError(resources_id)
        return (await self._loop.execute(rollout_id, cmd)).state.rollout

    async def _resources_exist(self, resources_id: str) -> bool:
        return is_token(resources_id) and await self._log().resources(resources_id) is not None

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | None | Unset = UNSET,
        last_heartbeat_time: float | None | Unset = UNSET,
        metadata: dict[str, Any] | None | Unset = UNSET,
    ) -> Attempt:
        check_payload(
            "update_attempt",
            c.UpdateAttempt(  # the status is the decider's to check (it names the valid ones)
                attempt_id=attempt_id,
                worker_id=worker_id,
                last_heartbeat_time=last_heartbeat_time,
                metadata=metadata,
            ),
        )
        cached = self._loop.cached(rollout_id)
        state = cached[0] if cached is not None else await self._loop.load(rollout_id)
        try:
            aid = state.attempt(attempt_id).attempt_id
        except ValueError:
            if cached is None:
                raise
            state, cached = await self._loop.load(rollout_id), None
            aid = state.attempt(attempt_id).attempt_id
        head = None
        if cached is not None and state.attempt(aid).status in ("preparing", "unresponsive"):
            # spans of other processes may have moved it: read the span head during the append
            head = asyncio.ensure_future(self._log().span_head(rollout_id, aid))
        cmd = c.UpdateAttempt(
            attempt_id=aid,
            status=status,
            worker_id=worker_id,
            last_heartbeat_time=last_heartbeat_time,
            metadata=metadata,
        )
        try:
            outcome = await self._loop.execute(rollout_id, cmd)
        except InvalidTransitionError:
            await self._release(rollout_id, aid)
            raise
        finally:
            if head is not None and not head.done():
                await asyncio.wait([head])
        new = outcome.state if head is None else self._loop.head_seen(outcome, aid, head.result())
        attempt = new.attempt(aid)
        if attempt.status in ENDED:
            await self._release(rollout_id, aid)
        return attempt

    async def _release(self, rollout_id: str, attempt_id: str) -> None:
        item = self._held.pop((rollout_id, attempt_id), None)
        if item is not None:
            with contextlib.suppress(Exception):
                await item.ack()

    # -- spans ----------------------------------------------------------------------------------

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        check_spans(spans)
        return await self._spans.add(spans, numbered=False)

    async def add_spans_numbered(self, rollout_id: str, attempt_id: str, spans: Sequence[Span]) -> list[Span]:
        """Give ``spans`` the attempt's next sequence ids, in order, and record them (one append).

        The spans' ``sequence_id`` fields are overwritten in place. Returns the spans recorded.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
            InvalidInputError: A span names another attempt or lacks its ids.
        """
        check_one_attempt(rollout_id, attempt_id, spans)
        for i, span in enumerate(spans):
            span.sequence_id = i + 1  # placeholders that pass validation; renumbered when appended
        check_spans(spans)
        return await self._spans.add(spans, numbered=True)

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        return await self._spans.reserve(rollout_attempt_ids)

    # -- resources ------------------------------------------------------------------------------

    async def _put(self, resources_id: str, resources: NamedResources, old: ResourcesUpdate | None) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        check_resources(resources)
        at = self._clock()
        snap = ResourcesUpdate(
            resources_id=resources_id,
            create_time=old.create_time if old else at,
            update_time=at,
            version=old.version + 1 if old else 1,
            resources=dict(resources),
        )
        check_payload("resources", snap)
        self._wrote(await self._log().publish(ResourcesPut(time=at, resources=snap)))
        return snap

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return await self._put(generate_id("rs-", 12), resources, None)

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        old = await self.get_resources_by_id(resources_id)
        if old is None:
            raise ResourcesNotFoundError(resources_id)
        return await self._put(resources_id, resources, old)

    async def put_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        return await self._put(resources_id, resources, await self.get_resources_by_id(resources_id))

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        if not isinstance(resources_id, str) or not is_token(resources_id):
            return None  # not a subject token: no snapshot can have this id
        return await self._log().resources(resources_id)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return await self._log().resources(None)

    # -- workers --------------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] | Unset = UNSET) -> Worker:
        """Record a heartbeat; also keeps this store's claimed queue entries in progress.

        Without a read model (a runner's store) the returned record holds only what this call knows.

        Raises:
            InvalidInputError: ``worker_id`` is not a token, or the stats are not JSON-encodable.
        """
        check_token("worker_id", worker_id)
        stats = None if isinstance(heartbeat_stats, Unset) else check_stats(heartbeat_stats)
        at = self._clock()
        self._wrote(await self._log().publish(WorkerHeartbeat(time=at, worker_id=worker_id, heartbeat_stats=stats)))
        for item in list(self._held.values()):
            with contextlib.suppress(Exception):
                await item.in_progress()
        if self._read_model is None:
            return Worker(worker_id=worker_id, heartbeat_stats=stats, last_heartbeat_time=at)
        found = await self.get_worker_by_id(worker_id)
        assert found is not None
        return found

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        page = await (await self._reads()).query_workers(worker_id_in=[worker_id])
        return page[0] if page else None

    # -- reads (the read model) -----------------------------------------------------------------

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
        return await (await self._reads()).query_rollouts(
            status_in=status_in,
            rollout_id_in=rollout_id_in,
            rollout_id_contains=rollout_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
            status=status,
            rollout_ids=rollout_ids,
        )

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        return await (await self._reads()).get_rollout_by_id(rollout_id)

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        reads = await self._reads()
        return await reads.query_attempts(
            rollout_id, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
        )

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        return await (await self._reads()).get_latest_attempt(rollout_id)

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        return await (await self._reads()).wait_for_rollouts(list(rollout_ids), timeout)

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
        return await (await self._reads()).query_spans(
            rollout_id,
            attempt_id,
            trace_id=trace_id,
            trace_id_contains=trace_id_contains,
            span_id=span_id,
            span_id_contains=span_id_contains,
            parent_id=parent_id,
            parent_id_contains=parent_id_contains,
            name=name,
            name_contains=name_contains,
            filter_logic=filter_logic,
            limit=limit,
            offset=offset,
            sort_by=sort_by,
            sort_order=sort_order,
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
        return await (await self._reads()).query_resources(
            resources_id=resources_id,
            resources_id_contains=resources_id_contains,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )

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
        return await (await self._reads()).query_workers(
            status_in=status_in,
            worker_id_contains=worker_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
            worker_id_in=worker_id_in,
        )

    async def statistics(self) -> dict[str, Any]:
        """Counts of rollouts, attempts, spans, resources and workers, plus ``name``."""
        return {"name": type(self).__name__, **await (await self._reads()).statistics()}
