"""Raw twins of eventlight's micro operations: the same messages on eventlight's own stream, by
nats-py and asyncpg alone, for ``bench.micro`` to run in blocks alternating with the operation.

A twin does the least physical work its operation needs, on the same servers and the same stream
(``EL_<NS>``: eventlight's stream config, its ``runners`` queue consumer, the projector's consumer
and the projector itself applying every message into Postgres in the driver's process), with the
same message bytes and headers eventlight sends. The bytes are templates copied from what
eventlight itself stored for one warm-up call of the operation (``get_last_msg``), with the ids
swapped, so the projector applies a twin's messages like the operation's own. A twin is what a
competent user would write with nats-py and asyncpg for the fastest round trips, not a handicapped
one: a pull waits for its answer on a subscription callback and a future (not ``next_msg``'s two
tasks a pull), a query's connection goes back to the pool without a reset round trip.

=================  ====================================================================================
operation          its twin (round trips, each awaited before the next)
=================  ====================================================================================
heartbeat          publish ``WorkerHeartbeat`` on ``w.<worker_id>`` (unfenced, ``Nats-Msg-Id``), as
                   eventlight publishes it
dequeue_empty      ``no_wait`` pull (batch 1) from the ``runners`` consumer; must answer 404
enqueue            publish ``RolloutCreated`` for a new rollout on ``r.<rid>.q``, fenced on the last
                   resources message (``Nats-Expected-Last-Subject-Sequence`` +
                   ``...-Subject: el.<ns>.res.>``), as eventlight's enqueue with resources is
dequeue            ``no_wait`` pull of one entry, then ``AttemptStarted`` on ``r.<rid>.e`` fenced on
                   ``r.<rid>.>`` at the entry's sequence (the entry stays held, as a claim's does;
                   an entry whose fence is stale, a redelivery of one claimed already, is acked and
                   counted as an empty result)
dequeue_update     the same, then ``AttemptUpdated(succeeded)`` fenced at the claim's sequence and
                   the entry's ack (a publish without reply, as eventlight's)
query_spans        ``SELECT`` of the rollout's 20 span rows from eventlight's own ``spans`` table, on a
                   pooled connection given back without asyncpg's ``RESET ALL`` round trip (as
                   eventlight's own pool does)
add_span           none: concurrent ``add_span`` calls share one message (group commit)
=================  ====================================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats
import nats.errors
import nats.js.errors

from bench.micro import EmptyResult
from eventlight.settings import Settings
from eventlight.store.jetstream.pg import SPAN_COLS

TWIN_OPS = ("heartbeat", "dequeue_empty", "enqueue", "dequeue", "dequeue_update", "query_spans")
"""The micro operations that have a twin (``add_span`` has none)."""

FENCE_SEQ = "Nats-Expected-Last-Subject-Sequence"
FENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
NO_WAIT_PULL = b'{"batch":1,"no_wait":true}'
WRONG_LAST_SEQUENCE = 10071  # JetStream's answer to a stale fence
PULL_ANSWER_S = 10.0  # a no_wait pull unanswered this long fails

Op = Callable[[int], Awaitable[Any]]


def swap_id(old: str) -> str:
    """A fresh id shaped like ``old``: its prefix up to the last ``-``, then as many random hex digits.

    >>> len(swap_id("ro-0123456789ab")) == len("ro-0123456789ab")
    True
    """
    head, sep, tail = old.rpartition("-")
    prefix = head + sep
    return prefix + os.urandom((len(tail) + 1) // 2 + 1).hex()[: len(tail)]


def _msg_id() -> str:
    return os.urandom(16).hex()


class _PullInbox:
    """One task's pull inbox: a subscription whose callback resolves the waiting pull's future; an
    entry nobody waits for (its pull timed out) is handed back at once."""

    def __init__(self) -> None:
        self.subject = ""
        self.waiter: asyncio.Future[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None

    async def subscribe(self, nc: Any) -> None:
        self.subject = nc.new_inbox()
        await nc.subscribe(self.subject, cb=self.deliver)

    def begin(self) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        self.timer = loop.call_later(PULL_ANSWER_S, _expire, waiter)
        return waiter

    def end(self) -> None:
        self.waiter = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def deliver(self, msg: Any) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
        elif msg.reply and (msg.headers or {}).get("Status") is None:
            with contextlib.suppress(Exception):
                await msg.nak()


async def _no_reset(conn: asyncpg.Connection) -> None:
    """A connection going back to the twins' pool: nothing to reset (the twins set no session state),
    so no ``RESET ALL`` round trip after each query, as eventlight's read-model pool does. asyncpg
    still rolls back an unfinished transaction before calling this."""


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(nats.errors.TimeoutError())


class OwnStreamRaw:
    """Twins on one namespace's stream and schema, on their own NATS connection and Postgres pool.

    Args:
        nc: A NATS connection of its own (not the stores').
        pool: An asyncpg pool of ``concurrency`` connections on eventlight's database.
        settings: The namespace's settings (stream ``EL_<NS>``, prefix ``el.<ns>``, schema ``el_<ns>``).
    """

    def __init__(self, nc: Any, pool: asyncpg.Pool, settings: Settings):
        self.nc = nc
        self.js = nc.jetstream(timeout=30.0)
        self.pool = pool
        self.prefix = settings.subject_prefix
        self.stream = settings.stream_name
        self.schema = settings.pg_schema
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.runners"
        self._inboxes: dict[int, _PullInbox] = {}

    @classmethod
    async def open(cls, nats_url: str, pg_dsn: str, settings: Settings, concurrency: int) -> OwnStreamRaw:
        """Connect to the stack's servers.

        Raises:
            OSError, nats.errors.Error, asyncpg.PostgresError: A server did not accept the connection.
        """
        nc = await nats.connect(nats_url)
        try:
            pool = await asyncpg.create_pool(pg_dsn, min_size=concurrency, max_size=concurrency, reset=_no_reset)
        except BaseException:
            await nc.close()
            raise
        return cls(nc, pool, settings)

    async def close(self) -> None:
        """Close the pool and the connection (idempotent)."""
        await self.pool.close()
        if not self.nc.is_closed:
            await self.nc.close()

    async def _last(self, subject: str) -> bytes:
        """The data of the last message on ``subject`` (a template)."""
        return bytes((await self.js.get_last_msg(self.stream, subject)).data or b"")

    async def twin(
        self, name: str, alg: Any, runner: Any, worker_ids: list[str], rollout_id: str | None = None
    ) -> Op | None:
        """The twin of micro operation ``name`` (``None`` for ``add_span``), made ready by one
        warm-up call of the operation itself on ``alg`` / ``runner`` (untimed) whose stored
        messages become the twin's templates. ``rollout_id`` names ``query_spans``' rollout.

        Raises:
            ValueError: ``name`` is not a micro operation, or ``query_spans`` without ``rollout_id``.
            RuntimeError: ``dequeue`` / ``dequeue_update`` found no queue entry to warm up with.
        """
        if name == "add_span":
            return None
        if name == "heartbeat":
            return await self._heartbeat(runner, worker_ids)
        if name == "dequeue_empty":
            return self._dequeue_empty
        if name == "enqueue":
            return await self._enqueue(alg)
        if name in ("dequeue", "dequeue_update"):
            return await self._dequeue(runner, worker_ids[0], update=name == "dequeue_update")
        if name == "query_spans":
            if rollout_id is None:
                raise ValueError("the query_spans twin needs the rollout_id it reads")
            return await self._query_spans(rollout_id)
        raise ValueError(f"no micro operation {name!r}; twins exist for {', '.join(TWIN_OPS)}")

    async def _heartbeat(self, runner: Any, worker_ids: list[str]) -> Op:
        wid = worker_ids[0]
        await runner.update_worker(wid, {"warm_up": True})
        template = await self._last(f"{self.prefix}.w.{wid}")
        data = [template.replace(wid.encode(), w.encode()) for w in worker_ids]
        subjects = [f"{self.prefix}.w.{w}" for w in worker_ids]

        async def heartbeat(w: int) -> None:
            await self.js.publish(subjects[w], data[w], headers={"Nats-Msg-Id": _msg_id()})

        return heartbeat

    async def _pull(self, w: int) -> Any:
        """A ``no_wait`` pull answered on task ``w``'s own inbox (kept for its next pull), as
        eventlight's queue does: JetStream delivers an entry under the entry's subject, which
        ``nc.request``'s shared inbox cannot route. The inbox's callback hands the answer to a
        future (one future and one timer a pull, no task), as eventlight's queue waits for it.

        Raises:
            nats.errors.TimeoutError: No answer in ``PULL_ANSWER_S`` seconds.
        """
        inbox = self._inboxes.get(w)
        if inbox is None:
            inbox = self._inboxes[w] = _PullInbox()
            await inbox.subscribe(self.nc)
        waiter = inbox.begin()
        await self.nc.publish(self.pull_subject, NO_WAIT_PULL, reply=inbox.subject)
        try:
            return await waiter
        except nats.errors.TimeoutError:
            del self._inboxes[w]  # a late answer must not answer the next pull: this inbox hands it back
            raise
        finally:
            inbox.end()

    async def _dequeue_empty(self, w: int) -> None:
        answer = await self._pull(w)
        status = (answer.headers or {}).get("Status")
        if status is None:
            await answer.nak()  # a queue entry: handed back at once
        if status != "404":
            raise RuntimeError(f"the runners queue is not empty (answer {status or answer.subject})")

    async def _enqueue(self, alg: Any) -> Op:
        rid = (await alg.enqueue_rollout(input="micro-raw-template", mode="train")).rollout_id
        template = await self._last(f"{self.prefix}.r.{rid}.q")
        fence = f"{self.prefix}.res.>"
        try:
            resources_seq = (await self.js.get_last_msg(self.stream, fence)).seq
        except nats.js.errors.NotFoundError:
            resources_seq = 0  # no resources yet: eventlight fences on their absence

        async def enqueue(w: int) -> None:
            new = swap_id(rid)
            headers = {"Nats-Msg-Id": _msg_id(), FENCE_SEQ: str(resources_seq), FENCE_SUBJECT: fence}
            await self.js.publish(
                f"{self.prefix}.r.{new}.q", template.replace(rid.encode(), new.encode()), headers=headers
            )

        return enqueue

    async def _dequeue(self, runner: Any, worker_id: str, *, update: bool) -> Op:
        claimed = await runner.dequeue_rollout(worker_id=worker_id)
        if claimed is None:
            raise RuntimeError("no queue entry to warm the dequeue twin up with")
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        started = await self._last(f"{self.prefix}.r.{rid}.e")
        await runner.update_attempt(rid, aid, status="succeeded")
        finished = await self._last(f"{self.prefix}.r.{rid}.e")

        def swapped(template: bytes, new_rid: str, new_aid: str) -> bytes:
            return template.replace(rid.encode(), new_rid.encode()).replace(aid.encode(), new_aid.encode())

        async def dequeue(w: int) -> None:
            entry = await self._pull(w)
            if (entry.headers or {}).get("Status") is not None:
                raise EmptyResult  # counted by bench.micro, not an op
            new_rid, new_aid = entry.subject.split(".")[3], swap_id(aid)
            subject, fence = f"{self.prefix}.r.{new_rid}.e", f"{self.prefix}.r.{new_rid}.>"
            headers = {"Nats-Msg-Id": _msg_id(), FENCE_SEQ: str(entry.metadata.sequence.stream), FENCE_SUBJECT: fence}
            try:
                ack = await self.js.publish(subject, swapped(started, new_rid, new_aid), headers=headers)
            except nats.js.errors.APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
                await entry.ack()  # claimed since it was queued (a redelivery): what eventlight does
                raise EmptyResult from e
            if update:
                headers = {"Nats-Msg-Id": _msg_id(), FENCE_SEQ: str(ack.seq), FENCE_SUBJECT: fence}
                await self.js.publish(subject, swapped(finished, new_rid, new_aid), headers=headers)
                await entry.ack()

        return dequeue

    async def _query_spans(self, rollout_id: str) -> Op:
        select = f"SELECT {SPAN_COLS} FROM {self.schema}.spans WHERE rollout_id = $1 ORDER BY sequence_id, stream_seq"
        async with self.pool.acquire() as conn:
            expected = len(await conn.fetch(select, rollout_id))

        async def query_spans(w: int) -> None:
            async with self.pool.acquire() as conn:
                if len(await conn.fetch(select, rollout_id)) != expected:
                    raise RuntimeError("the raw SELECT found another number of span rows")

        return query_spans
