"""Span appends per attempt, numbered by the stream, with group commit.

An attempt's spans live on ``el.<ns>.s.<rollout_id>.<attempt_id>``. Each ``SpansAdded`` carries
``seq_high``, the attempt's highest allocated sequence id after it, and every append expects the
subject's last stream sequence (``Nats-Expected-Last-Subject-Sequence``), so the subject itself is
the attempt's span counter: gap-free, strictly increasing in stream order, shared by every writer
(runner tracers, the LLM proxy, algorithms), durable with the events. A writer overtaken by another
(JetStream error 10071) reads the head (``JetStreamEventLog.span_counter``) and numbers again.

Within one process, appends to the same attempt are combined: while one append is in flight, the
requests that arrive meanwhile wait and then go out together in the next message (group commit),
so concurrent callers never conflict with each other and share one fsync.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eventlight.core.errors import ConcurrencyError, InvalidInputError, RolloutRetiredError
from eventlight.core.events import SpansAdded
from eventlight.core.types import Span
from eventlight.store.futures import mark_seen
from eventlight.store.ports import StaleStateError
from eventlight.store.validate import check_span_ids_left

if TYPE_CHECKING:
    from eventlight.store.jetstream.log import JetStreamEventLog

MAX_TRIES = 64
MAX_SPANS_PER_MESSAGE = 256
RECENT_ATTEMPTS = 256  # attempts whose span ids (duplicate checks) and span head this store remembers


@dataclass
class _Request:
    spans: list[Span]
    numbered: bool  # give the spans the next ids (else they carry their own)
    reserve: int  # ids to reserve after the spans (get_many_span_sequence_ids)
    msg_id: str
    done: asyncio.Future[tuple[int | None, float, int]]
    first: int = 0


@dataclass
class _Attempt:
    last_seq: int = 0  # the subject's last stream sequence as this process knows it (0: empty)
    high: int = 0  # the attempt's highest allocated sequence id as this process knows it
    pending: list[_Request] = field(default_factory=list)
    writer: asyncio.Task[None] | None = None


class SpanLog:
    """Appends span batches and sequence-id reservations of attempts.

    Args:
        log: The namespace's event log.
        clock: Wall-clock seconds (each batch's ``time``).
    """

    def __init__(self, log: JetStreamEventLog, clock: Callable[[], float]):
        self.log = log
        self.clock = clock
        self._attempts: dict[tuple[str, str], _Attempt] = {}

    async def append(
        self, rollout_id: str, attempt_id: str, spans: list[Span], *, numbered: bool = False, reserve: int = 0
    ) -> tuple[int | None, float, int]:
        """Append ``spans`` (and reserve ``reserve`` ids after them) to the attempt's subject.

        Returns:
            The first id given out (to the numbered spans, else to the reservation), or ``None`` if
            the server had already stored this very batch (a duplicate within its window); the
            message's ``time``; its stream sequence.

        Raises:
            ConcurrencyError: Other writers kept overtaking this one ``MAX_TRIES`` times in a row.
            ServiceUnavailableError: NATS did not answer.
        """
        keys = hashlib.blake2b("\n".join(sorted(s.span_id for s in spans)).encode(), digest_size=16)
        msg_id = f"spans:{rollout_id}:{attempt_id}:{keys.hexdigest()}:{reserve}" if spans else ""
        key = (rollout_id, attempt_id)
        state = self._attempts.get(key)
        if state is None:
            state = self._attempts[key] = _Attempt()
            while len(self._attempts) > RECENT_ATTEMPTS:
                oldest = next(iter(self._attempts))
                if self._attempts[oldest].writer is not None:
                    break
                del self._attempts[oldest]
        done: asyncio.Future[tuple[int | None, float, int]] = asyncio.get_running_loop().create_future()
        done.add_done_callback(mark_seen)  # a caller cancelled meanwhile never reads its error
        state.pending.append(_Request(spans, numbered, reserve, msg_id, done))
        if state.writer is None:
            state.writer = asyncio.create_task(self._write(key, state))
        return await asyncio.shield(done)

    async def _write(self, key: tuple[str, str], state: _Attempt) -> None:
        try:
            while state.pending:
                group: list[_Request] = []
                count = 0
                while state.pending and (not group or count + len(state.pending[0].spans) <= MAX_SPANS_PER_MESSAGE):
                    req = state.pending.pop(0)
                    group.append(req)
                    count += len(req.spans)
                try:
                    appended = await self._append_group(key, state, group)
                except BaseException as e:
                    for req in group:
                        if not req.done.done():
                            req.done.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                if appended is None:  # every request of the group was refused on its own
                    continue
                duplicate, at, seq = appended
                for req in group:
                    if not req.done.done():
                        req.done.set_result((None if duplicate else req.first, at, seq))
        finally:
            state.writer = None
            for req in state.pending:  # only when the writer itself was cancelled
                if not req.done.done():
                    req.done.set_exception(ConcurrencyError(f"span writer of {key[0]}/{key[1]} stopped"))
            state.pending.clear()

    async def _append_group(
        self, key: tuple[str, str], state: _Attempt, group: list[_Request]
    ) -> tuple[bool, float, int] | None:
        """Append the group's spans as one message, numbered from the attempt's head; ``None``
        when no request of it is left to append. A request that would number past
        ``MAX_SPAN_SEQUENCE_ID`` fails alone (``InvalidInputError``), as it would in a message of
        its own: the others of the group are appended."""
        rid, aid = key
        for _ in range(MAX_TRIES):
            cursor = state.high
            taken: list[_Request] = []
            for req in group:
                if req.done.done():
                    continue
                high = cursor + len(req.spans) if req.numbered else max([cursor, *(s.sequence_id for s in req.spans)])
                try:
                    check_span_ids_left(rid, aid, high + req.reserve)
                except InvalidInputError as e:
                    req.done.set_exception(e)
                    continue
                if req.numbered:
                    for j, span in enumerate(req.spans):
                        span.sequence_id = cursor + 1 + j
                    req.first = cursor + 1
                else:
                    req.first = high + 1
                cursor = high + req.reserve
                taken.append(req)
            if not taken:
                return None
            spans = [s for req in taken for s in req.spans]
            msg_id = taken[0].msg_id if len(taken) == 1 and taken[0].msg_id else None  # combined: a fresh id
            if state.last_seq == 0 and self.log.settings.retention_s is not None:
                await self._refuse_retired(rid)
            at = self.clock()
            event = SpansAdded(time=at, rollout_id=rid, attempt_id=aid, spans=spans, seq_high=cursor)
            try:
                seq, duplicate = await self.log.publish_ack(event, msg_id=msg_id, expected_subject_seq=state.last_seq)
            except StaleStateError:  # another process (the LLM proxy, another store) appended first
                state.last_seq, state.high = await self.log.span_counter(rid, aid)
                continue
            if duplicate:
                return True, at, seq
            state.last_seq, state.high = seq, cursor
            return False, at, seq
        raise ConcurrencyError(f"spans of {rid}/{aid}: {MAX_TRIES} conflicting appends in a row")

    async def _refuse_retired(self, rollout_id: str) -> None:
        """An empty span subject is a new attempt's, or a retired rollout's (retirement purged it).

        Raises:
            RolloutRetiredError: The latter.
        """
        if await self.log.retired.contains(rollout_id):
            raise RolloutRetiredError(rollout_id)
