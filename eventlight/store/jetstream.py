"""``JetStreamLightningStore``: writes are events on NATS JetStream, reads come from Postgres.

How each part of the API maps onto the event log (see DESIGN.md):

* **Writes** decide with ``eventlight.decider`` and append the resulting events with the rollout's
  expected last sequence (``EventLog.execute``); a stale append reloads the state and decides again.
* **The queue** is the durable pull consumer ``runners`` on ``el.<ns>.r.*.q``. ``dequeue_rollout``
  fetches one message and claims it by appending ``AttemptStarted`` expecting that message's
  sequence; if anything happened to the rollout since, the claim is refused, the state reloaded, and
  a rollout that is no longer queued is skipped. So two deliveries can never create two attempts.
  The message stays in progress (heartbeats extend it) until the attempt finishes.
* **Spans** are published in batches (``SpansAdded``) on ``el.<ns>.s.<rid>.<aid>``; that subject is
  the attempt's span sequence counter, shared with the LLM proxy, and concurrent appends of one
  process are combined into one message (``eventlight.store.spanlog``). ``add_spans_numbered``
  (what the tracer uses) numbers and publishes a batch in one round trip.
* **Reads** (``query_*``, ``get_*``) come from the Postgres projections and first wait until the
  projector's checkpoint has passed this store's last write (read-your-writes). Resources are also
  readable from the stream itself (``get_resources_by_id``, ``get_latest_resources``), so runners
  need no Postgres connection at all (``pg_dsn=None``).
* **wait_for_rollouts** listens to the rollouts' events on the stream (and to the local projector's
  commits) instead of polling.

Duplicate spans (same ``(rollout_id, attempt_id, span_id)``) are never stored twice: the projector
drops them. ``add_span``/``add_many_spans`` also report them at write time (``None`` / left out of
the result) when they repeat a span this store object already wrote (it remembers the span ids of
its last ``RECENT_ATTEMPTS`` attempts) or re-send the same batch from any process within the stream's
duplicate window (120 s, ``Nats-Msg-Id`` derived from the batch's span keys). A duplicate written
by another process after that window is dropped silently but returned as if recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

import asyncpg
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig

from eventlight import decider as d
from eventlight.errors import (
    AttemptNotFoundError,
    InvalidInputError,
    InvalidTransitionError,
    ResourcesNotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
)
from eventlight.events import (
    ResourcesPut,
    RolloutCreated,
    WorkerHeartbeat,
    WorkerIdle,
    decode_event,
)
from eventlight.settings import Settings
from eventlight.store import pg
from eventlight.store.base import UNSET, LightningStore, LightningStoreCapabilities
from eventlight.store.eventlog import EventLog, StaleStateError, connect_nats
from eventlight.store.projector import Projector
from eventlight.store.query import check_paging, deprecated_alias
from eventlight.store.spanlog import SpanLog
from eventlight.store.validate import (
    check_one_attempt,
    check_resources,
    check_spans,
    check_stats,
    check_token,
    is_token,
)
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

SPANS_PER_MESSAGE = 256
EMPTY_CONFIRM_S = 0.010  # how long after a write a non-blocking dequeue waits for the consumer (see _pull)
RECENT_ATTEMPTS = 256  # attempts whose span ids (duplicate checks) and span head this store remembers
RECENT_ROLLOUTS = 512  # rollout states cached (a missing one costs one reload from the stream)
MAX_HINTS = 100_000
SYNC_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0


class _Waiter:
    """A ``wait_for_rollouts`` call: the ids it still waits for; ``dirty`` once a projector commit
    in this process has put one of them in a terminal status (it then reads Postgres again)."""

    __slots__ = ("dirty", "ids")

    def __init__(self, ids: set[str]):
        self.ids = ids
        self.dirty = False


class _RolloutStatus(msgspec.Struct):
    status: str | None = None


class _StatusPeek(msgspec.Struct):
    """The rollout status an event carries, if any: ``AttemptStarted``/``AttemptUpdated``'s
    ``rollout_status``, ``RolloutCreated``/``RolloutUpdated``'s ``rollout.status``; decoding only
    these fields skips the rest of the event (inputs, metadata)."""

    rollout_status: str | None = None
    rollout: _RolloutStatus | None = None


_status_peek = msgspec.json.Decoder(_StatusPeek)


class _StreamTimes(msgspec.Struct):
    """What ``_last_write_age`` reads of a ``STREAM.INFO`` answer (RFC 3339 times, server clock)."""

    class _State(msgspec.Struct):
        last_ts: datetime | None = None

    ts: datetime | None = None
    state: _State | None = None


_stream_times_decoder = msgspec.json.Decoder(_StreamTimes)


class JetStreamLightningStore(LightningStore):
    """The event-sourced store.

    Args:
        settings: Namespace and (optionally) service addresses.
        nats_url: NATS server; defaults to ``settings.nats_url``.
        pg_dsn: Postgres DSN for reads; ``None`` opens a write-only store (what runners use).
        run_projector: Run the projector (and its watchdog) in this process. Defaults to ``True``
            when ``pg_dsn`` is given.
        pool_size: Upper bound of this store's Postgres connections (peer failure C25).
        watchdog_interval_s: Seconds between watchdog passes of the local projector.

    Use as ``async with JetStreamLightningStore(...) as store:`` or call ``start()``/``close()``.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        nats_url: str | None = None,
        pg_dsn: str | None = None,
        run_projector: bool | None = None,
        pool_size: int = 4,
        watchdog_interval_s: float = 1.0,
    ):
        self.settings = settings
        self.nats_url = nats_url or settings.nats_url
        self.pg_dsn = pg_dsn
        self.run_projector = (pg_dsn is not None) if run_projector is None else run_projector
        self.pool_size = pool_size
        self.watchdog_interval_s = watchdog_interval_s
        self.nc: NATS | None = None
        self.log: EventLog | None = None
        self.pool: asyncpg.Pool | None = None
        self.projector: Projector | None = None
        self._states: OrderedDict[str, tuple[d.RolloutState, int]] = OrderedDict()  # LRU, RECENT_ROLLOUTS
        self._held: dict[tuple[str, str], Any] = {}
        self._idle_workers: set[str] = set()
        self._span_log: SpanLog | None = None
        self._span_ids: dict[tuple[str, str], set[str]] = {}  # insertion-ordered, trimmed to RECENT_ATTEMPTS
        self._last_write_seq = 0
        self._changed = asyncio.Condition()
        self._hints: set[str] = set()
        self._waiters: list[_Waiter] = []
        self._runners_sub: Any = None
        self._pull_inboxes: list[Any] = []
        self._watch_sub: Any = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": True, "otlp_traces": False}

    async def start(self) -> JetStreamLightningStore:
        """Connect to NATS (and Postgres when ``pg_dsn`` is set); start the projector if asked.

        Raises:
            ServiceUnavailableError: A server cannot be reached.
        """
        if self.nats_url is None:
            raise InvalidInputError("JetStreamLightningStore needs a NATS URL (settings.nats_url or nats_url=)")
        if self.run_projector and self.pg_dsn is None:
            raise InvalidInputError("the projector needs Postgres (pg_dsn)")
        self.nc = await connect_nats(self.nats_url)
        try:
            self.log = EventLog(self.nc, self.settings)
            if self.pg_dsn is not None:
                self.pool = await pg.create_pool(self.pg_dsn, self.settings.pg_schema, max_size=self.pool_size)
                async with self.pool.acquire() as conn:
                    if await conn.fetchval("SELECT to_regclass('projector_checkpoint')") is None:
                        raise InvalidInputError(
                            f"namespace {self.settings.namespace!r} has no tables in Postgres schema "
                            f"{self.settings.pg_schema!r}; run `eventlight up` (or "
                            "eventlight.services.apply_migrations) first"
                        )
                # terminal statuses are only ever published on a rollout's ``e`` subject (``enters_queue``)
                self._watch_sub = await self.nc.subscribe(f"{self.log.prefix}.r.*.e", cb=self._on_rollout_event)
            if self.run_projector:
                assert self.pool is not None
                self.projector = Projector(
                    self.log, self.pool, watchdog_interval_s=self.watchdog_interval_s, on_commit=self._on_commit
                )
                await self.projector.start()
        except BaseException:
            await self.close()  # nothing half-open is left behind
            raise
        return self

    async def __aenter__(self) -> JetStreamLightningStore:
        return await self.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.projector is not None:
            await self.projector.close()
        for sub in (self._watch_sub, self._runners_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("Postgres connections did not close within %.0f s; terminating them", CLOSE_TIMEOUT_S)
                self.pool.terminate()

    def _log(self) -> EventLog:
        if self._closed:
            raise InvalidInputError("this store is closed")
        if self.log is None:
            raise InvalidInputError("the store is not started; use `async with store:` or `await store.start()`")
        return self.log

    # -- notifications -------------------------------------------------------------------------

    async def _on_rollout_event(self, msg: Any) -> None:
        try:
            peek = _status_peek.decode(msg.data)
        except msgspec.DecodeError:
            return
        status = peek.rollout_status if peek.rollout is None else peek.rollout.status
        if status in TERMINAL_ROLLOUT_STATUSES:
            rid = msg.subject.split(".")[3]
            if len(self._hints) >= MAX_HINTS:  # hints of rollouts nobody waits for; they only speed up waits
                self._hints.clear()
            self._hints.add(rid)
            await self._notify()

    def _on_commit(self, last_seq: int, finished: set[str]) -> None:
        for waiter in self._waiters:
            if not waiter.dirty and not waiter.ids.isdisjoint(finished):
                waiter.dirty = True
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- write helpers -------------------------------------------------------------------------

    def _remember(self, rollout_id: str, state: d.RolloutState, seq: int) -> None:
        """Cache a rollout's state and last sequence (a hint: a stale one costs one reload)."""
        self._states[rollout_id] = (state, seq)
        self._states.move_to_end(rollout_id)
        while len(self._states) > RECENT_ROLLOUTS:
            self._states.popitem(last=False)

    def _wrote(self, seq: int) -> None:
        self._last_write_seq = max(self._last_write_seq, seq)

    async def _execute(self, rollout_id: str, cmd: d.Command) -> d.RolloutState:
        cached = self._states.get(rollout_id)
        state, seq = cached if cached else (None, None)
        state, seq, events = await self._log().execute(rollout_id, cmd, state, seq)
        self._remember(rollout_id, state, seq)
        if events:
            self._wrote(seq)
        return state

    async def _resources_exist(self, resources_id: str) -> bool:
        if not isinstance(resources_id, str) or not is_token(resources_id):
            return False  # not a subject token: no snapshot can have this id
        return await self._log().last_event(f"{self._log().prefix}.res.{resources_id}") is not None

    async def _resolve_resources(self, resources_id: str | None) -> str | None:
        if resources_id is None:
            latest = await self.get_latest_resources()
            return latest.resources_id if latest else None
        check_token("resources_id", resources_id)
        if not await self._resources_exist(resources_id):
            raise ResourcesNotFoundError(resources_id)
        return resources_id

    async def _create(self, cmd: d.CreateRollout) -> d.RolloutState:
        events = d.decide(None, cmd, wall_clock())
        seq = await self._log().append(events, 0, uuid.uuid4().hex)
        state: d.RolloutState | None = None
        for e in events:
            state = d.evolve(state, e)
        assert state is not None
        self._remember(cmd.rollout_id, state, seq)
        self._wrote(seq)
        return state

    # -- rollouts --------------------------------------------------------------------------------

    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        rid = await self._resolve_resources(resources_id)
        cmd = d.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=rid,
            config=config,
            metadata=metadata,
        )
        return (await self._create(cmd)).rollout

    async def enqueue_many_rollouts(self, rollouts: Sequence[Any]) -> list[Rollout]:
        latest: str | None | type[UNSET] = UNSET
        cmds = []
        for r in rollouts:
            if r.resources_id is None:
                if latest is UNSET:
                    latest = await self._resolve_resources(None)
                res = latest
            else:
                res = await self._resolve_resources(r.resources_id)
            cmds.append(
                d.CreateRollout(
                    rollout_id=generate_id("ro-", 12),
                    input=r.input,
                    mode=r.mode,
                    resources_id=res,  # type: ignore[arg-type]
                    config=r.config,
                    metadata=r.metadata,
                )
            )
        states = await asyncio.gather(*(self._create(c) for c in cmds))
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
        cmd = d.CreateRollout(
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
        return (await self._create(cmd)).attempted()  # type: ignore[return-value]

    async def _runners(self) -> Any:
        if self._runners_sub is None:
            log_ = self._log()
            cfg = ConsumerConfig(
                durable_name="runners",
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30,
                max_ack_pending=10000,
                filter_subject=f"{log_.prefix}.r.*.q",
            )
            self._runners_sub = await log_.js.pull_subscribe(
                f"{log_.prefix}.r.*.q", durable="runners", stream=log_.stream, config=cfg
            )
        return self._runners_sub

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait_s: float = 0.0) -> AttemptedRollout | None:
        """Claim the oldest queued rollout.

        Args:
            worker_id: The claiming runner; becomes the attempt's ``worker_id``.
            wait_s: Seconds to wait for work when the queue is empty (eventlight extension; the
                Agent-lightning API is non-blocking, ``0``). Runners pass their poll interval so
                an idle runner sleeps in the server instead of spinning (peer failure C19).
        """
        if worker_id is not None:
            check_token("worker_id", worker_id)
        sub = await self._runners()
        if wait_s <= 0:  # non-blocking: a no-wait pull, confirmed while the stream is being written (see _pull)
            while True:
                msg = await self._pull()
                if msg is None:
                    await self._mark_idle(worker_id)
                    return None
                claimed = await self._claim(msg, worker_id)
                if claimed is not None:
                    if worker_id is not None:
                        self._idle_workers.discard(worker_id)
                    return claimed
        deadline = time.monotonic() + wait_s
        while True:
            timeout = max(0.05, deadline - time.monotonic())
            try:
                msgs = await sub.fetch(1, timeout=timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                await self._mark_idle(worker_id)
                return None
            if not msgs:  # nats-py may hand back an empty batch on a status message
                if time.monotonic() >= deadline:
                    await self._mark_idle(worker_id)
                    return None
                continue
            claimed = await self._claim(msgs[0], worker_id)
            if claimed is not None:
                if worker_id is not None:
                    self._idle_workers.discard(worker_id)
                return claimed
            if time.monotonic() >= deadline and wait_s > 0:
                await self._mark_idle(worker_id)
                return None

    async def _pull(self) -> Any:
        """The next message of the ``runners`` consumer, or ``None`` if the queue is empty, without
        nats-py's 50 ms minimum fetch wait.

        A ``no_wait`` pull answers at once, but from the consumer's own count of pending messages,
        which the server updates asynchronously after a publish is acknowledged: right after an
        enqueue (by any process) it can still say "no messages" (seen about once in 300 tries on a
        loaded machine; the rollout was visible 0.7-7.5 ms after its ack). So an empty answer stands
        only if the stream has had no write in the ``EMPTY_CONFIRM_S`` before it, by the server's
        clock (``_last_write_age``, one ``STREAM.INFO``); otherwise a pull that waits out the rest
        of that time confirms it. An empty queue thus answers in two round trips when the stream is
        quiet, and in about ``EMPTY_CONFIRM_S`` plus two round trips (12 ms p50 measured) right
        after any write to the namespace's stream, not only a queue write. Runners long-poll
        (``wait_s > 0``), which never takes this path.
        """
        started = time.monotonic()
        msg = await self._pull_request(b'{"batch":1,"no_wait":true}')
        if msg is not None:
            return msg
        age = await self._last_write_age()
        # the empty answer came at most `elapsed` before the age was read
        wait = EMPTY_CONFIRM_S if age is None else EMPTY_CONFIRM_S - age + (time.monotonic() - started)
        if wait <= 0:
            return None
        wait = min(wait, EMPTY_CONFIRM_S)
        return await self._pull_request(f'{{"batch":1,"expires":{max(1, int(wait * 1e9))}}}'.encode())

    async def _last_write_age(self) -> float | None:
        """Seconds since the stream's last message by the server's own clock (``STREAM.INFO``'s
        ``ts`` and ``state.last_ts``; nats-server >= 2.10), or ``None`` when the answer lacks them.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        log_ = self._log()
        try:
            reply = await log_.nc.request(f"$JS.API.STREAM.INFO.{log_.stream}", b"", timeout=10.0)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError) as e:
            raise ServiceUnavailableError(self.nats_url or "NATS", f"stream info failed: {e!r}") from e
        try:
            info = _stream_times_decoder.decode(reply.data)
        except msgspec.DecodeError:  # includes ValidationError: an error answer, another server
            return None
        if info.ts is None or info.state is None or info.state.last_ts is None:
            return None
        return (info.ts - info.state.last_ts).total_seconds()

    async def _pull_request(self, request: bytes) -> Any:
        """One pull request; JetStream delivers the message under its own subject, so each request
        needs an inbox of its own (idle inbox subscriptions are kept for the next call)."""
        log_ = self._log()
        inbox = self._pull_inboxes.pop() if self._pull_inboxes else await log_.nc.subscribe(log_.nc.new_inbox())
        try:
            await log_.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{log_.stream}.runners", request, reply=inbox.subject)
            msg = await inbox.next_msg(timeout=10.0)
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as e:
            with contextlib.suppress(Exception):
                await inbox.unsubscribe()  # a late answer must not reach the next caller
            raise ServiceUnavailableError(self.nats_url or "NATS", f"pull from the runners queue failed: {e!r}") from e
        self._pull_inboxes.append(inbox)
        status = (msg.headers or {}).get("Status")
        if status in ("404", "408"):
            return None
        if status is not None:
            raise ServiceUnavailableError(
                self.nats_url or "NATS", f"pull from the runners queue answered {status} {msg.headers}"
            )
        return msg

    async def _claim(self, msg: Any, worker_id: str | None) -> AttemptedRollout | None:
        log_ = self._log()
        seq = msg.metadata.sequence.stream
        event = decode_event(msg.data)
        rid = msg.subject.split(".")[3]
        state: d.RolloutState | None = None
        last: int | None = None
        if isinstance(event, RolloutCreated):
            state, last = d.RolloutState(rollout=event.rollout), seq
        cmd = d.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id, claim=True)
        for _ in range(3):
            if state is None or last is None:
                state, last = await log_.load(rid)
            if not d.is_claimable(state):
                await msg.ack()  # cancelled, revived or already claimed since it was queued
                return None
            events = d.decide(state, cmd, wall_clock())
            try:
                new_seq = await log_.append(events, last, f"claim:{seq}")
            except StaleStateError:
                state, last = None, None
                continue
            for e in events:
                state = d.evolve(state, e)
            assert state is not None
            self._remember(rid, state, new_seq)
            self._wrote(new_seq)
            self._held[(rid, cmd.attempt_id)] = msg
            return state.attempted()  # type: ignore[return-value]
        await msg.nak(delay=0.1)
        return None

    async def _mark_idle(self, worker_id: str | None) -> None:
        if worker_id is None or worker_id in self._idle_workers:
            return
        self._idle_workers.add(worker_id)
        self._wrote(await self._log().publish(WorkerIdle(time=wall_clock(), worker_id=worker_id)))

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        state = await self._execute(rollout_id, d.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id))
        return state.attempted()  # type: ignore[return-value]

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
        if resources_id is not UNSET and resources_id is not None and not await self._resources_exist(resources_id):
            raise ResourcesNotFoundError(resources_id)
        cmd = d.UpdateRollout(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        return (await self._execute(rollout_id, cmd)).rollout

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: Any = UNSET,
        worker_id: Any = UNSET,
        last_heartbeat_time: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Attempt:
        aid = (
            await self._check_attempt(rollout_id, attempt_id)
            if attempt_id != "latest"
            else ((await self._load(rollout_id)).attempt("latest").attempt_id)
        )
        cmd = d.UpdateAttempt(
            attempt_id=aid,
            status=status,
            worker_id=worker_id,
            last_heartbeat_time=last_heartbeat_time,
            metadata=metadata,
        )
        try:
            new = await self._execute(rollout_id, cmd)
        except InvalidTransitionError:
            await self._release(rollout_id, aid)
            raise
        attempt = new.attempt(aid)
        if attempt.status in ("succeeded", "failed", "timeout", "unresponsive"):
            await self._release(rollout_id, aid)
        return attempt

    async def _release(self, rollout_id: str, attempt_id: str) -> None:
        msg = self._held.pop((rollout_id, attempt_id), None)
        if msg is not None:
            with contextlib.suppress(Exception):
                await msg.ack()

    async def _load(self, rollout_id: str) -> d.RolloutState:
        state, seq = await self._log().load(rollout_id)
        self._remember(rollout_id, state, seq)
        return state

    # -- reads ---------------------------------------------------------------------------------

    def _pool(self) -> asyncpg.Pool:
        if self._closed:
            raise InvalidInputError("this store is closed")
        if self.pool is None:
            raise InvalidInputError("this store was opened without Postgres (pg_dsn=None); it cannot answer queries")
        return self.pool

    async def sync(self, seq: int | None = None, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes stream sequence ``seq`` (default: this store's last write).

        Raises:
            ServiceUnavailableError: The projector did not get there within ``timeout_s`` seconds.
        """
        target = self._last_write_seq if seq is None else seq
        if target == 0:
            return
        deadline = time.monotonic() + timeout_s
        if self.projector is not None and self.projector.leader.is_set():  # this process projects
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda: self.projector is not None and self.projector.checkpoint >= target
                        ),
                        timeout_s,
                    )
            if self.projector.checkpoint >= target:
                return
        else:  # another process projects (this one has none, or a standby): read its checkpoint
            async with self._pool().acquire() as conn:
                while time.monotonic() < deadline:
                    if await conn.fetchval("SELECT last_seq FROM projector_checkpoint") >= target:
                        return
                    await asyncio.sleep(0.005)
        raise ServiceUnavailableError(
            "projector",
            f"the projection did not reach stream sequence {target} within {timeout_s:.0f} s; "
            "is a projector running for this namespace?",
        )

    async def sync_all(self, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes everything on the stream now, whoever wrote it."""
        info = await self._log().js.stream_info(self._log().stream)
        await self.sync(info.state.last_seq, timeout_s)

    async def _attempt_map(self, conn: asyncpg.Connection, rollouts: list[Rollout]) -> dict[str, Attempt]:
        ids = [r.rollout_id for r in rollouts]
        rows = await conn.fetch(
            f"SELECT {pg.ATTEMPT_COLS} FROM attempts a WHERE (a.rollout_id, a.attempt_id) IN "
            "(SELECT rollout_id, latest_attempt_id FROM rollouts WHERE rollout_id = ANY($1::text[]))",
            ids,
        )
        return {row[0]: pg.attempt_from_row(row) for row in rows}

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
        status_in = deprecated_alias(status_in, status, "status_in", "status")
        rollout_id_in = deprecated_alias(rollout_id_in, rollout_ids, "rollout_id_in", "rollout_ids")
        await self.sync()
        w = pg.Where()
        w.within("status", status_in)
        w.within("rollout_id", rollout_id_in)
        w.contains("rollout_id", rollout_id_contains)
        n = len(w.args)
        check_paging(limit, offset, sort_order, filter_logic)
        tail = pg.order_page(Rollout, w, sort_by, sort_order, limit, offset, "created_seq")
        async with self._pool().acquire() as conn:
            if rollout_id_in is None and rollout_id_contains is None:
                # all rollouts, or a status filter: the total comes from the trigger-kept counts
                # (migrations/002), so a page costs the same on 10^2 or 10^6 rollouts
                rows = await pg.fetch_rows(conn, "rollouts", pg.ROLLOUT_COLS, w, filter_logic, tail)
                total = await conn.fetchval(
                    "SELECT coalesce(sum(n), 0) FROM rollout_status_counts"
                    + ("" if status_in is None else " WHERE status = ANY($1::text[])"),
                    *([] if status_in is None else [list(status_in)]),
                )
                total = int(total)
            else:
                rows, total = await pg.fetch_page(
                    conn, "rollouts", pg.ROLLOUT_COLS, w, filter_logic, tail, n, limit, offset
                )
            items = [pg.rollout_from_row(r) for r in rows]
            attempts = await self._attempt_map(conn, items)
        return pg.paginated([pg.attach(r, attempts.get(r.rollout_id)) for r in items], limit, offset, total)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        page = await self.query_rollouts(rollout_id_in=[rollout_id])
        return page[0] if page else None

    async def _require_rollout(self, conn: asyncpg.Connection, rollout_id: str) -> asyncpg.Record:
        row = await conn.fetchrow("SELECT latest_attempt_id FROM rollouts WHERE rollout_id = $1", rollout_id)
        if row is None:
            raise RolloutNotFoundError(rollout_id)
        return row

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        await self.sync()
        w = pg.Where()
        w.exact("rollout_id", rollout_id, must=True)
        tail = pg.order_page(Attempt, w, sort_by, sort_order, limit, offset, "sequence_id")
        async with self._pool().acquire() as conn:
            await self._require_rollout(conn, rollout_id)
            rows, total = await pg.fetch_page(conn, "attempts", pg.ATTEMPT_COLS, w, "and", tail, 1, limit, offset)
        return pg.paginated([pg.attempt_from_row(r) for r in rows], limit, offset, total)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        page = await self.query_attempts(rollout_id, sort_order="desc", limit=1)
        return page[0] if page else None

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` in a terminal status, once all are or ``timeout`` passes.

        Reads Postgres once at the start (one query while none is finished), then only when this
        process's projector commits a terminal status for one of them (or every 2 s), so a caller
        polling with short timeouts costs one query per call; with the projector elsewhere it
        follows the stream's terminal events (see the class docstring).

        Raises:
            RolloutNotFoundError: An id is unknown.
        """
        await self.sync()
        ids = list(dict.fromkeys(rollout_ids))
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        waiter = _Waiter(set(ids))
        self._waiters.append(waiter)
        try:
            by_id = await self._finished_among(ids)
            while True:
                if len(by_id) == len(ids) or (deadline is not None and time.monotonic() >= deadline):
                    return [by_id[r] for r in rollout_ids if r in by_id]
                waiter.ids.difference_update(by_id)
                self._hints.difference_update(by_id)
                local = self.projector is not None and self.projector.leader.is_set()
                if local:  # this process projects: its commits say when one of ours has finished (2 s: a fallback)
                    step = 2.0
                    ready: Any = lambda: waiter.dirty  # noqa: E731
                else:  # a terminal event seen on the stream is being projected elsewhere: poll until it is
                    step = 0.02 if self._hints.intersection(waiter.ids) else 2.0
                    ready = None
                remaining = None if deadline is None else deadline - time.monotonic()
                wait = step if remaining is None else max(0.0, min(step, remaining))
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        if ready is None:
                            await asyncio.wait_for(self._changed.wait(), wait)
                        else:
                            await asyncio.wait_for(self._changed.wait_for(ready), wait)
                if local and not waiter.dirty and wait < step:
                    continue  # the deadline came and no commit finished one of ours: nothing new to read
                waiter.dirty = False
                done = await self.query_rollouts(rollout_id_in=ids, status_in=sorted(TERMINAL_ROLLOUT_STATUSES))
                by_id = {r.rollout_id: r for r in done}
        finally:
            self._waiters.remove(waiter)

    async def _finished_among(self, ids: list[str]) -> dict[str, Rollout]:
        """The rollouts among ``ids`` in a terminal status, by id (the others' rows are not loaded).

        Raises:
            RolloutNotFoundError: An id is unknown.
        """
        async with self._pool().acquire() as conn:
            rows = await conn.fetch("SELECT rollout_id, status FROM rollouts WHERE rollout_id = ANY($1::text[])", ids)
        status = {r[0]: r[1] for r in rows}
        for rid in ids:
            if rid not in status:
                raise RolloutNotFoundError(rid)
        finished = [rid for rid in ids if status[rid] in TERMINAL_ROLLOUT_STATUSES]
        if not finished:
            return {}
        done = await self.query_rollouts(rollout_id_in=finished, status_in=sorted(TERMINAL_ROLLOUT_STATUSES))
        return {r.rollout_id: r for r in done}

    # -- spans ---------------------------------------------------------------------------------

    async def _check_attempt(self, rollout_id: str, attempt_id: str) -> str:
        cached = self._states.get(rollout_id)
        if cached is not None:
            try:
                return cached[0].attempt(attempt_id).attempt_id
            except ValueError:
                pass
        return (await self._load(rollout_id)).attempt(attempt_id).attempt_id

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        check_spans(spans)
        return await self._add_spans(spans, numbered=False)

    async def add_spans_numbered(self, rollout_id: str, attempt_id: str, spans: Sequence[Span]) -> list[Span]:
        """Give ``spans`` the attempt's next sequence ids, in order, and record them (one round trip).

        The spans' ``sequence_id`` fields are overwritten in place. Returns the spans recorded.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
            InvalidInputError: A span names another attempt or lacks its ids.
        """
        check_one_attempt(rollout_id, attempt_id, spans)
        for i, span in enumerate(spans):
            span.sequence_id = i + 1  # placeholders that pass validation; renumbered when published
        check_spans(spans)
        return await self._add_spans(spans, numbered=True)

    async def _add_spans(self, spans: Sequence[Span], *, numbered: bool) -> list[Span]:
        groups: dict[tuple[str, str], list[Span]] = {}
        for span in spans:
            groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
        for rid, aid in groups:
            await self._check_attempt(rid, aid)
        added: list[Span] = []
        for (rid, aid), group in groups.items():
            seen = self._span_ids.get((rid, aid))
            if seen is None:
                seen = self._span_ids[(rid, aid)] = set()
                while len(self._span_ids) > RECENT_ATTEMPTS:
                    del self._span_ids[next(iter(self._span_ids))]
            fresh, batch_ids = [], set()
            for span in group:  # the first of each span id that this store has not written yet
                if span.span_id not in seen and span.span_id not in batch_ids:
                    batch_ids.add(span.span_id)
                    fresh.append(span)
            for i in range(0, len(fresh), SPANS_PER_MESSAGE):
                chunk = fresh[i : i + SPANS_PER_MESSAGE]
                if await self._spans().append(rid, aid, chunk, numbered=numbered) is not None:
                    added.extend(chunk)
                seen.update(s.span_id for s in chunk)  # only once written: a failed publish may be retried
        return added

    def _spans(self) -> SpanLog:
        if self._span_log is None:
            self._span_log = SpanLog(self._log(), on_write=self._wrote)
        return self._span_log

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        counts: dict[tuple[str, str], int] = {}
        resolved: list[tuple[str, str]] = []
        for rid, aid in rollout_attempt_ids:
            key = (rid, await self._check_attempt(rid, aid))
            resolved.append(key)
            counts[key] = counts.get(key, 0) + 1
        next_id: dict[tuple[str, str], int] = {}
        for (rid, aid), n in counts.items():
            first = await self._spans().append(rid, aid, [], reserve=n)
            assert first is not None  # a reservation is never a duplicate
            next_id[(rid, aid)] = first
        out = []
        for key in resolved:
            out.append(next_id[key])
            next_id[key] += 1
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
        await self.sync()
        check_paging(limit, offset, sort_order, filter_logic)
        async with self._pool().acquire() as conn:
            row = await self._require_rollout(conn, rollout_id)
            w = pg.Where()
            w.exact("rollout_id", rollout_id, must=True)
            if attempt_id == "latest":
                if row[0] is None:
                    return PaginatedResult([], limit=limit, offset=offset, total=0)
                w.exact("attempt_id", row[0], must=True)
            elif attempt_id is not None:
                exists = await conn.fetchval(
                    "SELECT 1 FROM attempts WHERE rollout_id = $1 AND attempt_id = $2", rollout_id, attempt_id
                )
                if not exists:
                    raise AttemptNotFoundError(rollout_id, attempt_id)
                w.exact("attempt_id", attempt_id, must=True)
            for col, value in (
                ("trace_id", trace_id),
                ("span_id", span_id),
                ("parent_id", parent_id),
                ("name", name),
            ):
                w.exact(col, value)
            for col, needle in (
                ("trace_id", trace_id_contains),
                ("span_id", span_id_contains),
                ("parent_id", parent_id_contains),
                ("name", name_contains),
            ):
                w.contains(col, needle)
            n = len(w.args)
            tail = pg.order_page(Span, w, sort_by, sort_order, limit, offset, "sequence_id, stream_seq")
            rows, total = await pg.fetch_page(conn, "spans", pg.SPAN_COLS, w, filter_logic, tail, n, limit, offset)
        return pg.paginated([pg.span_from_row(r) for r in rows], limit, offset, total)

    # -- resources -----------------------------------------------------------------------------

    async def _put(self, resources_id: str, resources: NamedResources, old: ResourcesUpdate | None) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        check_resources(resources)
        at = wall_clock()
        snap = ResourcesUpdate(
            resources_id=resources_id,
            create_time=old.create_time if old else at,
            update_time=at,
            version=old.version + 1 if old else 1,
            resources=dict(resources),
        )
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
        found = await self._log().last_event(f"{self._log().prefix}.res.{resources_id}")
        return found[0].resources if found and isinstance(found[0], ResourcesPut) else None

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        found = await self._log().last_event(f"{self._log().prefix}.res.>")
        return found[0].resources if found and isinstance(found[0], ResourcesPut) else None

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
        await self.sync()
        w = pg.Where()
        w.exact("resources_id", resources_id, must=True)
        w.contains("resources_id", resources_id_contains)
        n = len(w.args)
        tail = pg.order_page(ResourcesUpdate, w, sort_by, sort_order, limit, offset, "created_seq")
        cols = "resources_id, create_time, update_time, version, resources::text"
        async with self._pool().acquire() as conn:
            rows, total = await pg.fetch_page(conn, "resources", cols, w, "and", tail, n, limit, offset)
        return pg.paginated([pg.resources_from_row(r) for r in rows], limit, offset, total)

    # -- workers -------------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        """Record a heartbeat; also keeps this store's claimed queue messages in progress.

        Without Postgres (a runner's store) the returned record holds only what this call knows.
        """
        check_token("worker_id", worker_id)
        stats = None if heartbeat_stats is UNSET else check_stats(heartbeat_stats)
        at = wall_clock()
        self._wrote(await self._log().publish(WorkerHeartbeat(time=at, worker_id=worker_id, heartbeat_stats=stats)))
        for msg in list(self._held.values()):
            with contextlib.suppress(Exception):
                await msg.in_progress()
        if self.pool is None:
            return Worker(worker_id=worker_id, heartbeat_stats=stats, last_heartbeat_time=at)
        found = await self.get_worker_by_id(worker_id)
        assert found is not None
        return found

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        page = await self.query_workers(worker_id_in=[worker_id])
        return page[0] if page else None

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
        await self.sync()
        check_paging(limit, offset, sort_order, filter_logic)
        w = pg.Where()
        w.within("worker_id", worker_id_in, must=True)
        w.within("status", status_in)
        w.contains("worker_id", worker_id_contains)
        n = len(w.args)
        tail = pg.order_page(Worker, w, sort_by, sort_order, limit, offset, "worker_id")
        async with self._pool().acquire() as conn:
            rows, total = await pg.fetch_page(conn, "workers", pg.WORKER_COLS, w, filter_logic, tail, n, limit, offset)
        return pg.paginated([pg.worker_from_row(r) for r in rows], limit, offset, total)

    async def statistics(self) -> dict[str, Any]:
        await self.sync()
        async with self._pool().acquire() as conn:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM attempts), "
                "(SELECT count(*) FROM spans), (SELECT count(*) FROM resources), (SELECT count(*) FROM workers), "
                "(SELECT last_seq FROM projector_checkpoint)"
            )
        keys = (
            "total_rollouts",
            "total_attempts",
            "total_spans",
            "total_resources",
            "total_workers",
            "projected_seq",
        )
        return {"name": type(self).__name__, **dict(zip(keys, row, strict=True))}
