"""``EventStore``'s plumbing: the two ports, the command loop over them, read-your-writes, closing."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from eventlight.core import commands as c
from eventlight.core.errors import (
    ConcurrencyError,
    InvalidInputError,
    ResourcesNotFoundError,
)
from eventlight.core.types import ResourcesUpdate
from eventlight.store.base import LightningStore
from eventlight.store.command_loop import MAX_APPEND_TRIES, CommandLoop
from eventlight.store.futures import cancels, mark_seen, wait_done
from eventlight.store.ports import EventLog, Queued, ReadModel, StaleStateError
from eventlight.store.spans import SpanWriter
from eventlight.store.validate import (
    check_token,
    is_token,
)

log = logging.getLogger(__name__)

UNSET = c.UNSET
BACKGROUND_CLOSE_WAIT_S = 5.0  # how long ``close`` lets a cancelled caller's claim settle
CLOSE_DRAIN_S = 5.0  # how long ``close`` lets the calls in flight finish before it closes the ports
Unset = c.Unset

P = ParamSpec("P")
T = TypeVar("T")

_inside: contextvars.ContextVar[object | None] = contextvars.ContextVar("eventlight_store_call", default=None)
"""The store whose public call this task (or the task that created it) is inside: calls the store
makes of itself (``dequeue_many_rollouts`` -> ``dequeue_rollout``, the settle of an abandoned claim
-> ``update_attempt``) are not counted again, and go on while the store closes."""


def store_call(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Mark a public method of the store as a call ``close`` waits for.

    While the store closes (``StorePlumbing.close``), a new call is refused with
    ``InvalidInputError``, and ``close`` waits up to ``CLOSE_DRAIN_S`` for the calls in flight, so
    a write that started before the close is stored and answered, not cut off with its connection.

    A caller cancelled during the call gets ``CancelledError`` even where a library swallowed the
    cancel (Python 3.11's ``asyncio.wait_for`` inside nats-py's publish returns the acknowledgement
    when a cancel lands as it arrives): else a loop of writes runs on after ``task.cancel()``, a
    ``TaskGroup`` with such a writer never ends, and ``asyncio.run``'s exit waits for it. What the
    call did stays done (as for any cancel that lands after a write left); a claim it made is
    settled (``_answer_lost``).
    """

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        store = args[0]
        assert isinstance(store, StorePlumbing)
        if _inside.get() is store:
            return await fn(*args, **kwargs)
        base = cancels()
        store._enter_call()
        token = _inside.set(store)
        try:
            result = await fn(*args, **kwargs)
        finally:
            _inside.reset(token)
            store._leave_call()
        if cancels() > base:  # the caller was cancelled, and a library swallowed it
            store._answer_lost(result)
            raise asyncio.CancelledError
        return result

    call.__store_call__ = True  # type: ignore[attr-defined]
    return call


async def _ack(item: Queued) -> None:
    with contextlib.suppress(Exception):  # if the connection is gone, the entry comes back after the ack wait
        await item.ack()


class StorePlumbing(LightningStore):
    """The ports, the command loop and span writer over them, read-your-writes, ``close``; the
    helpers every part of ``EventStore`` shares (resources resolution, releasing a claim)."""

    def __init__(self, log: EventLog | None, reads: ReadModel | None, clock: Callable[[], float]):
        self._clock = clock
        self._created_monotonic = time.monotonic()  # for statistics()["uptime"]
        self._last_write = 0
        self._held: dict[tuple[str, str], Queued] = {}
        self._claim_reads: dict[tuple[str, str], asyncio.Future[ResourcesUpdate | None]] = {}
        """Resources read alongside a claim (``dequeue_rollout(read_resources=True)``), until
        ``claimed_resources`` takes them or the attempt is released."""
        self._claims: dict[asyncio.Future[Any], tuple[Queued, str]] = {}
        """Claims in flight whose callers have not had their answer: the queue entry and attempt id."""
        self._background: set[asyncio.Task[None]] = set()
        """Work a cancelled caller left to finish (``_in_background``); ``close`` waits for it."""
        self._idle_marks: dict[str, float] = {}  # worker id -> clock of this store's last WorkerIdle
        self._left_queue: dict[str, int] = {}
        """Rollout id -> a log position where it was off the work queue (its claim by this store,
        say): a queue entry before it can never be claimed (``Claims._entry_is_last``)."""
        self._known_resources: set[str] = set()  # ids seen to exist (a snapshot id, once put, stays)
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # the close in progress (``close``)
        self._draining = False  # a close has begun: new calls are refused (``store_call``)
        self._calls = 0  # public calls in flight (``store_call``)
        self._drained: asyncio.Future[None] | None = None  # done when ``_calls`` falls to 0 in a close
        self._close_waiters: set[asyncio.Future[None]] = set()  # waits a close interrupts (``_unless_closing``)
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

    @property
    def closing(self) -> bool:
        """Whether ``close`` has begun (or is done): calls from outside the store are refused with
        ``InvalidInputError`` ("this store is closing", "this store is closed")."""
        return self._closed or self._draining

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(
                "this store is closed, and a closed store does not open again: open a new one"
                " (Trainer.fit and dev close a store they opened, such as a 'cs' run's trainer.store, at the run's end)"
            )
        if self._draining and _inside.get() is not self:
            raise InvalidInputError("this store is closing")
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

    # -- calls in flight, and closing ---------------------------------------------------------------

    def _enter_call(self) -> None:
        self._check_open()
        self._calls += 1

    def _leave_call(self) -> None:
        self._calls -= 1
        if self._calls == 0 and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def _unless_closing(self, work: Awaitable[T]) -> tuple[bool, T | None]:
        """Await ``work`` unless a close begins first: ``(True, its result)``, or ``(False, None)``
        with ``work`` cancelled. For the waits of a call (a long poll, ``wait_for_rollouts``) that
        would otherwise hold ``close`` up to ``CLOSE_DRAIN_S``.

        The caller's own cancellation reaches it here, not through ``work``: a library that swallows
        a cancel inside ``work`` (nats-py's ``wait_for`` on Python 3.11) cannot keep the caller
        running. ``work`` is then cancelled too.
        """
        task = asyncio.ensure_future(work)
        if self._draining:
            self._drop(task)
            return False, None
        try:
            await wait_done(task, wake=self._close_waiters)
        except asyncio.CancelledError:
            self._drop(task)
            raise
        if task.done():
            return True, task.result()
        self._drop(task)
        return False, None

    @staticmethod
    def _drop(task: asyncio.Future[Any]) -> None:
        """Cancel work nobody waits for any more; an error it still ends with (a swallowed cancel,
        then a closed connection) is not logged as never retrieved."""
        task.cancel()
        task.add_done_callback(mark_seen)

    def _begin_close(self) -> None:
        """Refuse new calls from now on, and end the waits of the calls in flight."""
        self._draining = True
        for waiter in list(self._close_waiters):
            if not waiter.done():
                waiter.set_result(None)

    async def _drain_calls(self) -> None:
        """Begin a close: refuse new calls, interrupt the waits of those in flight
        (``_unless_closing``), and give them up to ``CLOSE_DRAIN_S`` to finish."""
        self._begin_close()
        if self._calls > 0:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), CLOSE_DRAIN_S)
            except TimeoutError:
                log.warning("%d store calls in flight after %.0f s; closing under them", self._calls, CLOSE_DRAIN_S)
            finally:
                self._drained = None

    async def close(self) -> None:
        """Close the read model and the log; idempotent.

        New calls are refused from the start of the close (``InvalidInputError``); the calls in
        flight get up to ``CLOSE_DRAIN_S`` (5 s) to finish, and their waits end at once: a
        ``dequeue_rollout`` long poll returns ``None`` (an entry already on its way goes back to the
        queue), ``wait_for_rollouts`` returns what has finished. Then the claims of cancelled
        callers are settled (``Claims``), and the ports close. Concurrent calls wait for the one
        close (a caller cancelled meanwhile does not stop it); after a close that failed, the next
        call tries again."""
        closing = self._closing
        if closing is None or closing.done() or closing.get_loop() is not asyncio.get_running_loop():
            if self._closed:
                return
            self._begin_close()  # at once: a call made after ``close()`` was called is refused
            closing = self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(closing)  # also while ``_closed`` is set midway (JetStream's ``_close``)

    async def _close(self) -> None:
        """What ``close`` does once."""
        await self._drain_calls()
        await self._settle_abandoned_claims()  # while the ports are open
        self._closed = True
        self._cancel_claim_reads()
        for task in self._background:
            task.cancel()
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
        if not await self._resources_exist(resources_id):
            raise ResourcesNotFoundError(resources_id)
        return resources_id

    async def _resources_exist(self, resources_id: str) -> bool:
        if resources_id in self._known_resources:
            return True
        found = is_token(resources_id) and await self._log().resources(resources_id) is not None
        if found:
            self._known_resources.add(resources_id)
        return found

    async def _create_rollout(
        self, build: Callable[[str | None], c.CreateRollout], resources_id: str | None
    ) -> c.RolloutState:
        """Create the rollout ``build(resources id)`` describes: with ``resources_id`` (checked to
        exist), or else the latest resources, fenced: the log stores the rollout only if they are
        still the latest then (``EventLog.append(resources_seq=)``), so one append usually does it,
        with the latest id from this process's cache, and a stale one is read again and retried.

        Raises:
            ResourcesNotFoundError: ``resources_id`` names no snapshot.
            ConcurrencyError: The resources moved on before each of ``MAX_APPEND_TRIES`` appends.
            ServiceUnavailableError: A server did not answer.
        """
        if resources_id is not None:
            return await self._loop.create(build(await self._resolve_resources(resources_id)))
        log = self._log()
        for _ in range(MAX_APPEND_TRIES):
            latest, seq = await log.latest_resources()
            try:
                return await self._loop.create(build(latest), resources_seq=seq)
            except StaleStateError:
                log.forget_latest_resources()
        raise ConcurrencyError(
            f"the latest resources changed during each of {MAX_APPEND_TRIES} tries to create a rollout"
        )

    async def _settle_abandoned_claims(self) -> None:
        """Settle what cancelled callers left (``Claims``); called first by ``close``."""

    def _answer_lost(self, result: object) -> None:
        """A call returned ``result`` to a caller cancelled meanwhile, who gets ``CancelledError``
        instead (``store_call``): settle what it holds (``Claims``)."""

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on, whatever happens to the caller (kept referenced until it ends); the
        store's own calls it makes go on while the store closes (``store_call``)."""
        task = asyncio.ensure_future(self._as_store(work))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _as_store(self, work: Coroutine[Any, Any, None]) -> None:
        _inside.set(self)  # in this task's own context
        await work

    def _cancel_claim_reads(self) -> None:
        """Cancel the resources reads made with claims and not handed over (the store closes)."""
        for read in self._claim_reads.values():
            read.cancel()
        self._claim_reads.clear()

    async def _release(self, rollout_id: str, attempt_id: str) -> None:
        """Drop what this store holds for a finished attempt; acknowledge its queue entry.

        The acknowledgement is sent from a task of its own, which starts at the event loop's next
        turn: a runner's next ``dequeue_rollout`` has made its pull by then, and on JetStream both
        leave in one write (one write a rollout fewer; ``close`` waits for it). While the store
        closes, it is sent before this returns."""
        read = self._claim_reads.pop((rollout_id, attempt_id), None)
        if read is not None:
            read.cancel()
        item = self._held.pop((rollout_id, attempt_id), None)
        if item is None:
            return
        if self._draining:
            await _ack(item)
        else:
            self._in_background(_ack(item))
