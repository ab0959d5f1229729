"""Reading the stream by sequence from the checkpoint, and ``rebuild`` (mixed into ``Projector``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Any

from eventlight.core.commands import RolloutState
from eventlight.store.fold import in_flight
from eventlight.store.futures import cancels, raise_if_cancelled
from eventlight.store.jetstream.definitions import consumer_config
from eventlight.store.jetstream.nats_errors import NO_MESSAGES
from eventlight.store.jetstream.projector.batch import BatchWriter
from eventlight.store.jetstream.projector.common import (
    BATCH,
    NOT_THE_EVENTS,
    READ_ERRORS,
    RETRY_MAX_S,
    RETRY_S,
    TRANSIENT,
    Deposed,
    _Gap,
)
from eventlight.store.watchdog import Watchdog

log = logging.getLogger(__name__)

REBUILD_AHEAD = 4
"""Batches a rebuild reads ahead of its writes."""


def _seq_range(msgs: list[Any]) -> str:
    return f"{msgs[0].metadata.sequence.stream}-{msgs[-1].metadata.sequence.stream}"


class _Replayed:
    """A stored message read by ``rebuild`` in the shape ``apply`` takes (no ack)."""

    class _Meta:
        class _Seq:
            def __init__(self, seq: int):
                self.stream = seq

        def __init__(self, seq: int):
            self.sequence = self._Seq(seq)

    def __init__(self, seq: int, subject: str, data: bytes):
        self.metadata = self._Meta(seq)
        self.subject = subject
        self.data = data


def _cancelled() -> bool:
    """Whether the current task is being cancelled (inside a ``finally``)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Consumer(BatchWriter):
    """Reads the stream from the checkpoint and applies it batch by batch; ``rebuild`` from 0."""

    watchdog: Watchdog
    last_error: BaseException | None
    _lock_lost: asyncio.Event
    _stopping: bool

    async def _project(self) -> None:
        """Read the stream from the checkpoint and apply it batch by batch, in order."""
        while not self._stopping:
            psub = await self._subscribe(self.checkpoint)
            try:
                await self._consume(psub)
            except _Gap as e:
                log.warning("projector: %s; reading again from stream sequence %d", e, self.checkpoint + 1)
            except (Deposed, asyncio.CancelledError):
                raise
            except READ_ERRORS as e:
                log.warning(
                    "projector: reading the stream failed (%s: %s); reading again from the checkpoint",
                    type(e).__name__,
                    e,
                )
                await asyncio.sleep(RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()
                if self._stopping or not _cancelled():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.log.js.delete_consumer(self.log.stream, psub._consumer), 2)
                # else cancelled from outside (``asyncio.run`` ending with the store open): NATS's read
                # loop may be cancelled too, so no answer would come; the consumer expires on its own

    async def _consume(self, psub: Any) -> None:
        delivered = 0  # the consumer's delivery sequence: no acks, so no redelivery, so no gap
        base = cancels()
        while not self._stopping:
            try:
                msgs = await psub.fetch(BATCH, timeout=0.25)
            except NO_MESSAGES:
                raise_if_cancelled(base)
                continue
            raise_if_cancelled(base)  # a cancel nats-py's wait_for swallowed
            if not msgs:  # nats-py may return an empty batch (a status message, not an error)
                continue
            for i, msg in enumerate(msgs):
                if msg.metadata.sequence.consumer != delivered + 1:
                    msgs = msgs[:i]
                    if msgs:
                        await self._apply_until_done(msgs)
                    raise _Gap(f"delivery {delivered + 1} expected, {msg.metadata.sequence.consumer} came")
                delivered += 1
            await self._apply_until_done(msgs)

    async def _apply_until_done(self, msgs: list[Any]) -> None:
        """Apply one fetched batch, retrying *this* batch until it is done (or the projector stops
        or is deposed): the checkpoint moves only past what was applied. An event that cannot be
        projected on its own is dead-lettered (``_apply_isolating``); a failure of the servers
        (``TRANSIENT``: Postgres refusing connections, "too many clients", a lost connection) is
        retried after ``RETRY_S`` seconds, then at doubling intervals up to ``RETRY_MAX_S``, one
        warning line a try (anything else also logs its traceback)."""
        delay = RETRY_S
        while not self._stopping:
            try:
                try:
                    await self.apply(msgs)
                except NOT_THE_EVENTS:
                    raise
                except Exception:  # some event of the batch cannot be projected: find it, keep the others
                    await self._apply_isolating(msgs)
                return
            except Deposed:
                raise
            except Exception as e:
                what = "projector batch (stream sequences %s) failed: %r; retrying it in %.1f s"
                if isinstance(e, TRANSIENT):
                    log.warning(what, _seq_range(msgs), e, delay)
                else:
                    log.exception(what, _seq_range(msgs), e, delay)
                if self._lock_lost.is_set():
                    raise Deposed("the advisory-lock connection to Postgres was lost") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _apply_isolating(self, msgs: list[Any]) -> None:
        """Apply a batch one message at a time; a message that fails on its own with anything but a
        server failure (``TRANSIENT``) is recorded in ``projector_dead_letters`` and skipped: the
        stream keeps it, and the projection goes on. The skip is logged once it is committed; when
        the write fails (``Deposed``: another projector leads now; a server failure), a warning says
        the event was not skipped, and the error goes up (the batch is retried, or the new leader
        projects it)."""
        for msg in msgs:
            try:
                await self.apply([msg])
            except NOT_THE_EVENTS:
                raise
            except Exception as e:
                seq = msg.metadata.sequence.stream
                try:
                    async with self.pool.acquire() as conn, conn.transaction():
                        await self._advance(conn, seq)
                        await self._dead_letter(conn, [(seq, msg.subject, f"{type(e).__name__}: {e}")])
                except Exception as write_error:
                    log.warning(
                        "projector: the event at stream sequence %d (%s) failed (%r) and was not dead-lettered"
                        " (%r): it is not skipped",
                        seq,
                        msg.subject,
                        e,
                        write_error,
                    )
                    raise
                log.error(
                    "projector: skipped the event at stream sequence %d (%s), recorded in projector_dead_letters: %r",
                    seq,
                    msg.subject,
                    e,
                )
                self.checkpoint = seq
                self.dead_letters += 1
                if self.on_commit is not None:
                    self.on_commit(seq, set())

    async def _subscribe(self, after_seq: int) -> Any:
        """An ephemeral consumer of the whole namespace from stream sequence ``after_seq + 1``,
        without acknowledgements (the checkpoint in Postgres is the position)."""
        template = consumer_config("projector", self.log.settings.namespace)  # streams/003_projector.json
        cfg = dataclasses.replace(
            template, name=f"projector-{self.term}-{uuid.uuid4().hex[:8]}", opt_start_seq=after_seq + 1
        )
        return await self.log.js.pull_subscribe(f"{self.log.prefix}.>", stream=self.log.stream, config=cfg)

    async def rebuild(self, batch_size: int = BATCH) -> int:
        """Project the whole log into this projector's schema (empty tables expected), without the
        consumer or the leader lock; returns the last stream sequence applied.

        The log is read with ``EventLog.scan`` (an ordered consumer, up to the head when the rebuild
        starts) in a task of its own, a few batches ahead of the writes, so reading NATS and
        writing Postgres overlap.

        Raises:
            ServiceUnavailableError: NATS or Postgres failed.
        """
        row = await self.pool.fetchrow("SELECT term, last_seq FROM projector_checkpoint WHERE id = $1", self.partition)
        self.term, self.checkpoint = int(row["term"]), int(row["last_seq"])
        batches: asyncio.Queue[list[Any] | BaseException | None] = asyncio.Queue(maxsize=REBUILD_AHEAD)
        reader = asyncio.create_task(self._read_batches(batches, batch_size))
        try:
            while (batch := await batches.get()) is not None:
                if isinstance(batch, BaseException):
                    raise batch
                await self.apply(batch)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        return self.checkpoint

    async def _read_batches(self, out: asyncio.Queue[list[Any] | BaseException | None], batch_size: int) -> None:
        """Put the log after the checkpoint into ``out`` in batches, then ``None`` (or the error)."""
        prefix = self.log.prefix + "."
        batch: list[Any] = []
        try:
            async for seq, subject, data in self.log.scan(self.checkpoint):
                batch.append(_Replayed(seq, prefix + subject, data))
                if len(batch) >= batch_size:
                    await out.put(batch)
                    batch = []
        except Exception as e:  # handed to the writer, which raises it
            await out.put(e)
            return
        if batch:
            await out.put(batch)
        await out.put(None)

    def in_flight(self) -> list[tuple[str, RolloutState, int]]:
        """``(rollout_id, state, version)`` of the rollouts the watchdog watches."""
        return [(rid, self.states[rid], self.rollout_seq.get(rid, 0)) for rid in in_flight(self.states)]

    async def watch_once(self, now: float | None = None) -> int:
        """One watchdog tick; how many attempts it marked ``timeout``/``unresponsive``."""
        return len(await self.watchdog.tick(now))
