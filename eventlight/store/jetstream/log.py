"""The event log on JetStream: fenced appends per rollout, loads, span heads, resources, reads.

A rollout's state events live under ``el.<ns>.r.<rollout_id>.{q,e}`` (``layout``). An append
carries ``Nats-Expected-Last-Subject-Sequence`` with ``Nats-Expected-Last-Subject-Sequence-Subject:
el.<ns>.r.<rollout_id>.>`` (nats-server >= 2.11; error 10071 when stale) and a ``Nats-Msg-Id`` built
from the command id, so a retried publish is de-duplicated by the server. A rollout's version is
the stream sequence of its last state event. Concurrent appends of this process travel as one
JetStream atomic batch (``appender``: group commit, one fsync for all).

A load folds the rollout's state events and, in stream order among them, the last span batch of
each of its attempts (one direct get per attempt), so the state a writer decides on includes what
spans did to its attempts (``eventlight.core.evolve.spans_arrived``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from eventlight.core.commands import RolloutState
from eventlight.core.errors import EventlightError, InvalidInputError, RolloutNotFoundError, RolloutRetiredError
from eventlight.core.events import (
    AnyEvent,
    AttemptStarted,
    AttemptUpdated,
    ResourcesPut,
    RolloutCreated,
    RolloutEvent,
    RolloutUpdated,
    decode_event,
    encode_event,
)
from eventlight.core.evolve import evolve, spans_arrived
from eventlight.core.types import ResourcesUpdate, Span, generate_id
from eventlight.settings import Settings
from eventlight.store.jetstream.appender import AtomicAppender, publish_acked
from eventlight.store.jetstream.archive import ArchivedRollouts, RetiredLedger, scan_log
from eventlight.store.jetstream.connect import connected_server
from eventlight.store.jetstream.follow import SERVER_TIMEOUT_S, JetStreamFeed
from eventlight.store.jetstream.layout import rollout_filter, span_subject, subject_for
from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors
from eventlight.store.jetstream.queue import JetStreamQueued, RunnersQueue
from eventlight.store.jetstream.spanlog import SpanLog
from eventlight.store.ports import SpanHead
from eventlight.store.validate import is_token

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 10.0  # a publish (or an atomic batch's commit) unanswered this long: NATS is down


class _SpanHead(msgspec.Struct):
    """The part of a ``SpansAdded`` payload a head needs (decoded without the spans' bodies)."""

    class _Seq(msgspec.Struct):
        sequence_id: int = 0

    spans: list[_Seq]  # required, like the type: another JSON object is not a batch
    type: str = ""
    v: int = 1
    time: float = 0.0
    seq_high: int = 0


_span_head_decoder = msgspec.json.Decoder(_SpanHead)


def _span_batch(data: bytes | None) -> _SpanHead | None:
    """The head fields of a span batch, or ``None`` if ``data`` is not one."""
    if not data:
        return None
    try:
        head = _span_head_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):  # DecodeError includes ValidationError
        return None
    return head if head.type == "spans_added" else None


def _span_high(head: _SpanHead) -> int:
    return max([head.seq_high, *(s.sequence_id for s in head.spans)])


class JetStreamEventLog:
    """Appends and reads the events of one namespace.

    Args:
        nc: A connected NATS client.
        settings: Names the stream (``EL_<NS>``) and the subject prefix (``el.<ns>``).
        clock: Wall-clock seconds (the time of span batches).
    """

    def __init__(self, nc: NATS, settings: Settings, clock: Any):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self.settings = settings
        self.prefix = settings.subject_prefix
        self.stream = settings.stream_name
        self.spans = SpanLog(self, clock)
        self.queue = RunnersQueue(self)
        self.retired = RetiredLedger(self)
        self.archived = ArchivedRollouts(self)
        self.appender = AtomicAppender(self, timeout_s=PUBLISH_TIMEOUT_S)
        self._latest_resources: tuple[str | None, int] | None = None
        """``latest_resources``' cache: (id, the stream sequence of the last message on ``res.>``)."""
        self.direct_gets = False
        """Read single messages with JetStream's direct get (``$JS.API.DIRECT.GET``: the stored
        message as it is, about 40 % less client CPU than ``STREAM.MSG.GET``'s JSON and base64);
        ``learn_replicas`` turns it on for a stream of one replica. A replicated stream's followers
        answer direct gets too and may lag the leader, so there every read goes to the leader's
        ``STREAM.MSG.GET``, as it does until the stream's replicas are known."""

    def server(self) -> str:
        """The connected server's URL, for error messages."""
        return connected_server(self.nc)

    async def learn_replicas(self) -> None:
        """Read the stream's replica count (one ``STREAM.INFO``) and use direct gets if it is 1.

        The stream's own configuration decides, not this process's settings: another process may
        have created it with replicas (``EVENTLIGHT_STREAM_REPLICAS``, ``replicated``). A stream
        that does not answer (not created yet) keeps the leader's reads.
        """
        try:
            with nats_errors(self.server, f"stream info {self.stream}"):
                info = await self.js.stream_info(self.stream)
        except (EventlightError, JsNotFoundError) as e:
            log.debug("%s: replicas unknown (%s); single-message reads go to the leader", self.stream, e)
            self.direct_gets = False
            return
        self.direct_gets = (info.config.num_replicas or 1) == 1

    # -- appends ---------------------------------------------------------------------------

    async def publish_ack(
        self, event: AnyEvent, *, msg_id: str | None = None, expected_subject_seq: int | None = None
    ) -> tuple[int, bool]:
        """Publish one event alone; its stream sequence and whether the server had ``msg_id`` already.

        ``expected_subject_seq`` fences the event's own subject (``0``: the subject must be empty).
        Rollout commands go through ``append`` instead (fenced on the rollout, batched).

        Raises:
            StaleStateError: The fence is stale.
            InvalidInputError: The event is over the server's ``max_payload``.
            ServiceUnavailableError: NATS did not answer.
        """
        subject = subject_for(self.prefix, event)
        headers: dict[str, str] = {"Nats-Msg-Id": msg_id or generate_id("", 32)}
        if expected_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_subject_seq)
        data = encode_event(event)
        limit = self.nc.max_payload
        if limit and len(data) > limit:
            raise InvalidInputError(
                f"the event for {subject} is {len(data):,} bytes, over the NATS server's max_payload of {limit:,} "
                "bytes: store large inputs elsewhere and pass a reference, or split span batches"
            )
        with nats_errors(self.server, f"publish to {subject}"):
            return await publish_acked(self.nc, subject, data, headers, PUBLISH_TIMEOUT_S)

    async def publish(self, event: AnyEvent) -> int:
        """Publish an unfenced event (a worker heartbeat, resources); it may share an atomic batch."""
        seq = await self.appender.send(self.appender.command([event], None, None))
        if isinstance(event, ResourcesPut):
            cached = self._latest_resources
            if cached is None or cached[1] < seq:  # the fence of a later create checks it is still the last
                self._latest_resources = (event.resources.resources_id, seq)
        return seq

    async def append(
        self,
        rollout_id: str,
        events: Sequence[RolloutEvent],
        expected: int,
        command_id: str,
        *,
        resources_seq: int | None = None,
    ) -> int:
        """Append a command's events, fenced on the rollout at ``expected``; concurrent commands of
        this process share one atomic batch (``appender``). With ``resources_seq`` (a new rollout,
        ``expected=0``) the first message is fenced on the resources subjects (``res.>``) instead:
        the server stores it only while the last resources message is still at ``resources_seq``
        (the new rollout's own subjects are empty: its id was generated by this process).

        Raises:
            StaleStateError: ``expected`` is not the rollout's version, or the resources moved on.
            InvalidInputError: An event is over the server's ``max_payload`` (nothing is sent).
            ServiceUnavailableError: NATS did not answer.
        """
        if resources_seq is None:
            return await self.appender.send(self.appender.command(events, expected, command_id))
        fence = f"{self.prefix}.res.>"
        return await self.appender.send(self.appender.command(events, resources_seq, command_id, fence_subject=fence))

    async def append_spans(
        self, rollout_id: str, attempt_id: str, spans: list[Span], *, numbered: bool, reserve: int = 0
    ) -> tuple[int | None, float, int]:
        return await self.spans.append(rollout_id, attempt_id, spans, numbered=numbered, reserve=reserve)

    async def next_queued(self, wait_s: float) -> JetStreamQueued | None:
        return await self.queue.next(wait_s)

    # -- reads -----------------------------------------------------------------------------

    async def load(self, rollout_id: str) -> tuple[RolloutState, int]:
        if not isinstance(rollout_id, str) or not is_token(rollout_id):
            raise RolloutNotFoundError(rollout_id)  # not a subject token: no rollout can have this id
        items: list[tuple[int, AnyEvent]] = []
        async for msg in self._messages(rollout_filter(self.prefix, rollout_id)):
            if msg.data:
                items.append((msg.seq, decode_event(msg.data)))
        state: RolloutState | None = None
        for _, event in items:
            state = evolve(state, event)
        if state is None:
            if await self.retired.contains(rollout_id):
                raise RolloutRetiredError(rollout_id)
            raise RolloutNotFoundError(rollout_id)
        version = items[-1][0]
        aids = [a.attempt_id for a in state.attempts]
        heads = await asyncio.gather(*(self.span_head(rollout_id, aid) for aid in aids))
        spans = [(h.seq, aid, h.time) for aid, h in zip(aids, heads, strict=True) if h.has_spans]
        if not spans:
            return state, version
        state = None
        merged: list[tuple[Any, ...]] = sorted([*items, *spans], key=lambda item: item[0])
        for item in merged:
            if len(item) == 2:
                state = evolve(state, item[1])
            elif state is not None:
                state = spans_arrived(state, item[1], item[2])
        assert state is not None
        return state, version

    async def state_event_after(self, rollout_id: str, seq: int) -> tuple[int, RolloutEvent] | None:
        """The rollout's first state event after position ``seq`` (one direct get), or ``None``.

        Raises:
            InvalidInputError: The stored event cannot be decoded.
            ServiceUnavailableError: NATS did not answer.
        """
        subject = rollout_filter(self.prefix, rollout_id)
        with nats_errors(self.server, f"reading {subject}"):
            try:
                msg = await self.js.get_msg(
                    self.stream, seq=seq + 1, subject=subject, next=True, direct=self.direct_gets
                )
            except JsNotFoundError:
                return None
        event = decode_event(msg.data or b"")
        if not isinstance(event, (RolloutCreated, AttemptStarted, AttemptUpdated, RolloutUpdated)):
            raise InvalidInputError(f"the message at {msg.seq} on {subject} is not a rollout event")
        return int(msg.seq or 0), event

    async def _messages(self, subject: str, from_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[Any]:
        """The stored messages on ``subject`` (wildcards allowed) after ``from_seq``, in stream
        order, one direct get each, up to ``until_seq``.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        seq = from_seq
        while until_seq is None or seq < until_seq:
            with nats_errors(self.server, f"reading {subject}"):
                try:
                    msg = await self.js.get_msg(
                        self.stream, seq=seq + 1, subject=subject, next=True, direct=self.direct_gets
                    )
                except JsNotFoundError:
                    return
            seq = int(msg.seq or seq + 1)
            yield msg

    async def read(self, from_seq: int = 0) -> AsyncIterator[tuple[int, AnyEvent]]:
        """Every event of the namespace after ``from_seq``, in stream order (one direct get each).

        Raises:
            InvalidInputError: A stored message is not an event.
        """
        async for msg in self._messages(f"{self.prefix}.>", from_seq):
            if msg.data:
                yield msg.seq, decode_event(msg.data)

    async def head_seq(self) -> int:
        """The stream's last sequence now (0: empty); what a bounded ``scan`` reads up to.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        with nats_errors(self.server, f"stream info {self.stream}"):
            info = await self.js.stream_info(self.stream)
        return int(info.state.last_seq)

    async def scan(self, from_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[tuple[int, str, bytes]]:
        """The raw log after ``from_seq`` up to ``until_seq`` (default: the head now), in stream order,
        as ``(sequence, subject without the el.<ns>. prefix, payload)``; nothing is decoded or written.

        Read with an ordered consumer (ephemeral, flow-controlled push consumer; JetStream's way to
        read a stream fast and in order), not one direct get per message as ``read``. Replay, export,
        rebuild and the benchmarks use it. Where the namespace has an archive, the archive first and
        then the hot stream after it, one log by stream sequence (``archive.scan_log``).

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        until = await self.head_seq() if until_seq is None else until_seq
        async for entry in scan_log(self, from_seq, until):
            yield entry

    async def last_event(self, subject: str) -> tuple[AnyEvent, int] | None:
        """The last event on a subject (wildcards allowed), or ``None``."""
        with nats_errors(self.server, f"reading {subject}"):
            try:
                msg = await self.js.get_msg(self.stream, subject=subject, direct=self.direct_gets)
            except JsNotFoundError:
                return None
        return decode_event(msg.data or b""), int(msg.seq or 0)

    async def resources(self, resources_id: str | None) -> ResourcesUpdate | None:
        subject = f"{self.prefix}.res.{'>' if resources_id is None else resources_id}"
        try:
            found = await self.last_event(subject)
        except InvalidInputError:  # a foreign last message: the last valid snapshot before it
            log.warning("%s: the last message is not a resources snapshot; reading back past it", subject)
            return await self._last_valid_resources(subject)
        return found[0].resources if found and isinstance(found[0], ResourcesPut) else None

    async def latest_resources(self) -> tuple[str | None, int]:
        """The latest resources snapshot's id and the stream sequence of the last message on
        ``res.>`` (``0``: none), from the cache this process keeps (its own ``publish`` of a snapshot
        updates it), else one direct get. A stale cache is caught by the fence of the append that
        uses it (``append(resources_seq=)``); ``forget_latest_resources`` then drops it.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        cached = self._latest_resources
        if cached is not None:
            return cached
        subject = f"{self.prefix}.res.>"
        msg = await self._last_msg(subject)
        if msg is None:
            found: tuple[str | None, int] = (None, 0)
        else:
            try:
                event = decode_event(msg.data or b"")
            except InvalidInputError:
                event = None
            if isinstance(event, ResourcesPut):
                latest: ResourcesUpdate | None = event.resources
            else:  # a foreign last message: the last valid snapshot before it, fenced at that message
                log.warning("%s: the last message is not a resources snapshot; reading back past it", subject)
                latest = await self._last_valid_resources(subject)
            found = (latest.resources_id if latest else None, int(msg.seq or 0))
        cached = self._latest_resources
        if cached is None or cached[1] < found[1]:
            self._latest_resources = found
        return self._latest_resources or found

    def forget_latest_resources(self) -> None:
        self._latest_resources = None

    async def _last_valid_resources(self, subject: str) -> ResourcesUpdate | None:
        last: ResourcesUpdate | None = None
        async for msg in self._messages(subject):
            try:
                event = decode_event(msg.data or b"")
            except InvalidInputError:
                continue
            if isinstance(event, ResourcesPut):
                last = event.resources
        return last

    async def _last_msg(self, subject: str) -> Any:
        with nats_errors(self.server, f"reading {subject}"):
            try:
                return await self.js.get_msg(self.stream, subject=subject, direct=self.direct_gets)
            except JsNotFoundError:
                return None

    async def span_head(self, rollout_id: str, attempt_id: str) -> SpanHead:
        """The attempt's last span batch (a last message that is a reservation has no spans)."""
        msg = await self._last_msg(span_subject(self.prefix, rollout_id, attempt_id))
        head = _span_batch(msg.data) if msg is not None else None
        if msg is None or head is None:
            return SpanHead()
        return SpanHead(seq=msg.seq, time=head.time, has_spans=bool(head.spans))

    async def span_counter(self, rollout_id: str, attempt_id: str) -> tuple[int, int]:
        """The attempt's span subject head: ``(last stream sequence or 0, highest allocated id)``.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        subject = span_subject(self.prefix, rollout_id, attempt_id)
        msg = await self._last_msg(subject)
        if msg is None:
            return 0, 0
        head = _span_batch(msg.data)
        if head is not None:
            return msg.seq, _span_high(head)
        high = 0  # the last message is not a span batch (a foreign writer): read them all
        async for m in self._messages(subject, until_seq=msg.seq):
            found = _span_batch(m.data)
            high = max(high, _span_high(found) if found is not None else 0)
        log.warning("%s: the last message (stream sequence %d) is not a span batch; ignored", subject, msg.seq)
        return msg.seq, high

    # -- subscribers ---------------------------------------------------------------------------

    async def follow(
        self, durable: str | None, since: int | None, server_timeout_s: float = SERVER_TIMEOUT_S
    ) -> JetStreamFeed:
        """A feed of the rollout events (``follow``: the consumer, durable or ephemeral).

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        return await JetStreamFeed(self, durable, since, server_timeout_s).open()

    async def rollout_entries(self, rollout_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The rollout's state events before ``before_seq`` (one direct get each); none for an id
        that is not a subject token (no rollout can have it). A rollout retired to the archive
        (the hot stream holds none of its events and the ledger lists it) is read from the archive
        (``ArchivedRollouts``: one read of the archive through for the rollouts asked meanwhile).

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        if not isinstance(rollout_id, str) or not is_token(rollout_id):
            return []
        out: list[tuple[int, bytes]] = []
        async for msg in self._messages(rollout_filter(self.prefix, rollout_id)):
            if msg.seq >= before_seq:
                return out  # the hot stream holds it
            out.append((int(msg.seq), msg.data or b""))
        if out or not await self.retired.contains(rollout_id):
            return out
        state = f"{self.prefix}.r.{rollout_id}."
        return [(p, d) for p, s, d in await self.archived.entries(rollout_id) if p < before_seq and s.startswith(state)]

    async def span_entries(self, rollout_id: str, attempt_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The attempt's span batches before ``before_seq`` (one direct get each); from the archive
        for a rollout ``rollout_entries`` found retired.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        subject = span_subject(self.prefix, rollout_id, attempt_id)
        out = await self._entries(subject, before_seq)
        if out or rollout_id not in self.retired.ids:
            return out
        return [(p, d) for p, s, d in await self.archived.entries(rollout_id) if p < before_seq and s == subject]

    async def _entries(self, subject: str, before_seq: int) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        async for msg in self._messages(subject, until_seq=before_seq - 1):
            if msg.seq >= before_seq:
                break
            out.append((int(msg.seq), msg.data or b""))
        return out

    async def close(self) -> None:
        """Unsubscribe the runners' queue (the store closes the connection)."""
        await self.queue.close()
