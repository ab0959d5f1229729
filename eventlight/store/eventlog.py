"""The event log on JetStream: optimistic appends per rollout, state loading, sequence counters.

Each rollout's state events live under ``el.<ns>.r.<rollout_id>.{q,e}``. An append carries
``Nats-Expected-Last-Subject-Sequence`` with ``Nats-Expected-Last-Subject-Sequence-Subject:
el.<ns>.r.<rollout_id>.>`` (nats-server >= 2.11; error 10071 when stale) and a ``Nats-Msg-Id`` built
from the command id, so a retried publish is de-duplicated by the server. Span batches, resources and
worker events use their own subjects and no expected sequence.

Span sequence ids need no counter of their own: an attempt's span batches live on
``el.<ns>.s.<rollout_id>.<attempt_id>``, each carries ``seq_high`` (the attempt's highest allocated id
after it), and every append to that subject expects the subject's last sequence
(``Nats-Expected-Last-Subject-Sequence``). A writer that knows the subject's head numbers its spans
``seq_high + 1 …`` and publishes in one round trip; a writer that was overtaken (error 10071) reads
the head (``span_head``) and tries again. So the runner's tracer and the LLM proxy share one
gap-free, strictly increasing counter per attempt whose order is the stream's order, durably,
with one fsync per batch instead of a separate counter write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from eventlight import decider as d
from eventlight.errors import ConcurrencyError, EventlightError, RolloutNotFoundError, ServiceUnavailableError
from eventlight.events import AnyEvent, RolloutEvent, decode_event, encode_event, subject_for
from eventlight.settings import Settings
from eventlight.store.validate import is_token

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071
MAX_APPEND_TRIES = 16


class _SpanHead(msgspec.Struct):
    """The part of a ``SpansAdded`` payload that ``span_head`` needs (decoded without the spans' bodies)."""

    class _Seq(msgspec.Struct):
        sequence_id: int = 0

    spans: list[_Seq]  # required, like the type: another JSON object is not a batch
    type: str = ""
    v: int = 1
    seq_high: int = 0


_span_head_decoder = msgspec.json.Decoder(_SpanHead)


def _span_high(data: bytes | None) -> int | None:
    """The highest sequence id a span batch allocated, or ``None`` if ``data`` is not one."""
    if not data:
        return None
    try:
        head = _span_head_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):  # DecodeError includes ValidationError
        return None
    if head.type != "spans_added":  # another JSON object is not a batch
        return None
    return max([head.seq_high, *(s.sequence_id for s in head.spans)])


class StaleStateError(Exception):
    """An append's expected sequence was stale (JetStream error 10071); reload and decide again."""


class EventLog:
    """Appends and reads events of one namespace.

    Args:
        nc: A connected NATS client.
        settings: Names the stream (``EL_<NS>``) and the subject prefix (``el.<ns>``).
    """

    def __init__(self, nc: NATS, settings: Settings):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=10.0)
        self.settings = settings
        self.prefix = settings.subject_prefix
        self.stream = settings.stream_name

    # -- appends ---------------------------------------------------------------------------

    async def publish(self, event: AnyEvent, *, msg_id: str | None = None, expected_seq: int | None = None) -> int:
        """Publish one event and return its stream sequence.

        Raises:
            StaleStateError: ``expected_seq`` is not the rollout's last sequence any more.
            ServiceUnavailableError: NATS did not answer.
        """
        return (await self.publish_ack(event, msg_id=msg_id, expected_seq=expected_seq))[0]

    async def publish_ack(
        self,
        event: AnyEvent,
        *,
        msg_id: str | None = None,
        expected_seq: int | None = None,
        expected_subject_seq: int | None = None,
    ) -> tuple[int, bool]:
        """Publish one event; returns its stream sequence and whether the server saw ``msg_id`` already
        (within the stream's duplicate window; the event was then not stored again).

        ``expected_seq`` fences the rollout's whole subject tree (``r.<rid>.>``);
        ``expected_subject_seq`` fences the event's own subject (``0``: the subject must be empty).

        Raises:
            StaleStateError: ``expected_seq`` is not the rollout's last sequence any more.
            ServiceUnavailableError: NATS did not answer.
        """
        subject = subject_for(self.prefix, event)
        headers: dict[str, str] = {"Nats-Msg-Id": msg_id or uuid.uuid4().hex}
        if expected_seq is not None:
            rid = subject.split(".")[3]
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_seq)
            headers["Nats-Expected-Last-Subject-Sequence-Subject"] = f"{self.prefix}.r.{rid}.>"
        elif expected_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_subject_seq)
        try:
            ack = await self.js.publish(subject, encode_event(event), headers=headers)
        except nats.js.errors.APIError as e:
            if e.err_code == WRONG_LAST_SEQUENCE:
                raise StaleStateError(str(e)) from e
            raise
        except (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionClosedError,
        ) as e:
            raise ServiceUnavailableError(self._server(), f"publish to {subject} failed: {e!r}") from e
        return ack.seq, bool(ack.duplicate)

    async def append(self, events: Sequence[RolloutEvent], expected_seq: int, command_id: str) -> int:
        """Append a rollout's events in order, each expecting the previous one's sequence."""
        seq = expected_seq
        for i, event in enumerate(events):
            seq = await self.publish(event, msg_id=f"{command_id}:{i}", expected_seq=seq)
        return seq

    async def execute(
        self,
        rollout_id: str,
        make_command: d.Command,
        state: d.RolloutState | None = None,
        last_seq: int | None = None,
    ) -> tuple[d.RolloutState, int, list[RolloutEvent]]:
        """Load (or take) a rollout's state, decide, append; retry with fresh state on conflict.

        Returns:
            The new state, its last stream sequence, and the events appended (empty if none).

        Raises:
            RolloutNotFoundError: The rollout has no events.
            ConcurrencyError: Still conflicting after ``MAX_APPEND_TRIES`` reloads.
            InvalidTransitionError / AttemptNotFoundError: from the decider.
        """
        command_id = uuid.uuid4().hex
        fresh = False
        for attempt in range(MAX_APPEND_TRIES):
            if state is None or last_seq is None:
                state, last_seq = await self.load(rollout_id)
                fresh = True
            try:
                events = d.decide(state, make_command, self.now())
            except EventlightError:
                if fresh:
                    raise
                state, last_seq = None, None  # a cached state may be stale: decide again on the log's
                continue
            if not events:
                if fresh:
                    return state, last_seq, []
                state, last_seq = None, None
                continue
            try:
                seq = await self.append(events, last_seq, f"{command_id}:{attempt}")
            except StaleStateError:
                state, last_seq = None, None
                continue
            for event in events:
                state = d.evolve(state, event)
            assert state is not None
            return state, seq, events
        raise ConcurrencyError(f"rollout {rollout_id}: {MAX_APPEND_TRIES} conflicting appends in a row")

    def now(self) -> float:
        from eventlight.types import now

        return now()

    # -- reads from the stream -------------------------------------------------------------

    async def load(self, rollout_id: str) -> tuple[d.RolloutState, int]:
        """Rebuild a rollout's state from its state events (not its spans).

        Raises:
            RolloutNotFoundError: The rollout has no events.
        """
        if not isinstance(rollout_id, str) or not is_token(rollout_id):
            raise RolloutNotFoundError(rollout_id)  # not a subject token: no rollout can have this id
        subject = f"{self.prefix}.r.{rollout_id}.>"
        state: d.RolloutState | None = None
        seq = 0
        async for msg in self._messages(subject):
            seq = msg.seq
            if msg.data:
                state = d.evolve(state, decode_event(msg.data))
        if state is None:
            raise RolloutNotFoundError(rollout_id)
        return state, seq

    async def _messages(self, subject: str, until_seq: int | None = None) -> AsyncIterator[Any]:
        """The stored messages on ``subject`` (wildcards allowed) in stream order, one direct get each,
        up to ``until_seq``.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        seq = 0
        while until_seq is None or seq < until_seq:
            try:
                msg = await self.js.get_msg(self.stream, seq=seq + 1, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return
            except nats.errors.TimeoutError as e:
                raise ServiceUnavailableError(self._server(), f"reading {subject} timed out") from e
            seq = msg.seq
            yield msg

    async def last_event(self, subject: str) -> tuple[AnyEvent, int] | None:
        """The last event on a subject (wildcards allowed), or ``None``."""
        try:
            msg = await self.js.get_msg(self.stream, subject=subject)
        except nats.js.errors.NotFoundError:
            return None
        return decode_event(msg.data), msg.seq

    # -- span sequence ids -----------------------------------------------------------------

    async def span_head(self, rollout_id: str, attempt_id: str) -> tuple[int, int]:
        """The attempt's span subject head: ``(last stream sequence or 0, highest allocated id)``.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        subject = f"{self.prefix}.s.{rollout_id}.{attempt_id}"
        try:
            msg = await self.js.get_msg(self.stream, subject=subject)
        except nats.js.errors.NotFoundError:
            return 0, 0
        except nats.errors.TimeoutError as e:
            raise ServiceUnavailableError(self._server(), f"reading {subject} timed out") from e
        high = _span_high(msg.data)
        if high is None:  # the last message is not a span batch (a foreign writer): read them all
            high = 0
            async for m in self._messages(subject, until_seq=msg.seq):
                high = max(high, _span_high(m.data) or 0)
            log.warning("%s: the last message (stream sequence %d) is not a span batch; ignored", subject, msg.seq)
        return msg.seq, high

    def _server(self) -> str:
        url = self.nc.connected_url
        return f"nats://{url.hostname}:{url.port}" if url else "NATS"


async def _nats_error(e: Exception) -> None:
    log.warning("NATS: %s", e if str(e) else type(e).__name__)


async def _reachable(url: str, timeout_s: float = 3.0) -> str | None:
    """``None`` if something accepts TCP connections at the first server of ``url``, else why not."""
    from urllib.parse import urlsplit

    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as e:
        return f"nothing answers at {host}:{port} ({e.strerror or type(e).__name__})"
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return None


async def connect_nats(url: str, *, name: str = "eventlight") -> NATS:
    """Connect to NATS and check the server can do per-rollout optimistic appends.

    Raises:
        ServiceUnavailableError: The server cannot be reached (at once when nothing listens, instead
            of nats-py's reconnect attempts), or is older than 2.11 (it ignores
            ``Nats-Expected-Last-Subject-Sequence-Subject``, which eventlight's fencing needs).
    """
    import nats

    why = await _reachable(url)
    if why is not None:
        raise ServiceUnavailableError(url, f"NATS is not reachable: {why}")
    try:
        nc = await nats.connect(
            url,
            name=name,
            connect_timeout=3,
            max_reconnect_attempts=5,
            allow_reconnect=True,
            error_cb=_nats_error,
        )
    except Exception as e:  # nats-py raises several unrelated types for "cannot connect"
        raise ServiceUnavailableError(url, f"NATS did not accept a connection ({e!r})") from e
    sv = nc.connected_server_version
    if (sv.major, sv.minor) < (2, 11):
        await nc.close()
        raise ServiceUnavailableError(
            url,
            f"nats-server {nc.connected_server_version} is too old: eventlight needs >= 2.11 "
            "(per-rollout expected-sequence appends); unset EVENTLIGHT_NATS_URL to use the bundled 2.15",
        )
    return nc
