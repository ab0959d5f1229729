"""``EventStore``'s plumbing: the two ports, the command loop over them, read-your-writes, closing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from eventlight.core import commands as c
from eventlight.core.errors import (
    ConcurrencyError,
    InvalidInputError,
    ResourcesNotFoundError,
)
from eventlight.core.types import ResourcesUpdate
from eventlight.store.base import LightningStore
from eventlight.store.command_loop import MAX_APPEND_TRIES, CommandLoop
from eventlight.store.ports import EventLog, Queued, ReadModel, StaleStateError
from eventlight.store.spans import SpanWriter
from eventlight.store.validate import (
    check_token,
    is_token,
)

UNSET = c.UNSET
BACKGROUND_CLOSE_WAIT_S = 5.0  # how long ``close`` lets a cancelled caller's claim settle
Unset = c.Unset


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
        self._known_resources: set[str] = set()  # ids seen to exist (a snapshot id, once put, stays)
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # the close in progress (``close``)
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
        """Close the read model and the log; idempotent. Concurrent calls wait for the one close
        (a caller cancelled meanwhile does not stop it); after a close that failed, the next call
        tries again."""
        closing = self._closing
        if closing is None or closing.done():
            if self._closed:
                return
            closing = self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(closing)  # also while ``_closed`` is set midway (JetStream's ``_close``)

    async def _close(self) -> None:
        """What ``close`` does once."""
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

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on, whatever happens to the caller (kept referenced until it ends)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _cancel_claim_reads(self) -> None:
        """Cancel the resources reads made with claims and not handed over (the store closes)."""
        for read in self._claim_reads.values():
            read.cancel()
        self._claim_reads.clear()

    async def _release(self, rollout_id: str, attempt_id: str) -> None:
        read = self._claim_reads.pop((rollout_id, attempt_id), None)
        if read is not None:
            read.cancel()
        item = self._held.pop((rollout_id, attempt_id), None)
        if item is not None:
            with contextlib.suppress(Exception):
                await item.ack()
