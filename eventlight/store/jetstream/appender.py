"""Group commit of one process's appends: concurrent commands travel as one JetStream atomic batch.

While ``PLAIN_WINDOW`` appends are in flight as plain publishes, the appends that other commands of
this process ask for meanwhile wait, and then go out together as one atomic batch (ADR-50,
nats-server >= 2.12): every message
keeps its own subject and headers, the first message of each command carries its rollout's fence
(``Nats-Expected-Last-Subject-Sequence`` + ``...-Subject: el.<ns>.r.<rid>.>``), the batch headers
``Nats-Batch-Id`` / ``Nats-Batch-Sequence`` (and ``Nats-Batch-Commit: 1`` on the last) bind them,
and the server stores all of them or none under one commit (one fsync covers them all). The
messages get consecutive stream sequences ending at the commit's ack.

* An append that finds fewer than ``PLAIN_WINDOW`` in flight and none waiting goes alone as plain
  publishes (no added latency). A batch costs 4 fsyncs on nats-server 2.15.1 (``sync_interval:
  always``, 2 to 200 messages), a plain publish one, so fewer than ``MIN_BATCH_MESSAGES`` waiting
  messages go as concurrent plain publishes too.
* Two commands of one rollout never share a batch (the second would be checked against the
  sequence before the batch); it waits for the next one. For the same reason a resources
  snapshot and a new rollout fenced on the resources (``log.append(resources_seq=)``) never share
  one (the create would pass its check and name the snapshot before).
* A batch stays within the server's limits: ``MAX_BATCH_MESSAGES`` (nats-server's default
  ``max_batch_size``, 1000) and ``max_payload`` bytes in all; more waits for the next batch.
* All-or-nothing: one stale fence rejects the whole batch (error 10071). Each of its commands is
  then re-submitted alone as plain publishes, concurrently, so only the stale one gets
  ``StaleStateError`` (the command loop reloads and decides again) and its neighbours land.
  Re-submission is also what de-duplicates: batch messages carry their ``Nats-Msg-Id``, and
  nats-server 2.15.1 rejects a whole batch holding an id already in its duplicate window (error
  10201) where a plain publish answers "duplicate" with the first sequence; alone, the repeated
  command gets that answer (a repeated command also fails its fence in a batch: 10071).
* A stream without ``allow_atomic`` (created by an older eventlight) or a server that refuses the
  batch for another reason (too many batches in flight) gets the same plain re-submission.
* At durability ``interval`` every append goes as plain publishes (``batches`` is off): there a
  plain publish costs no fsync, while an atomic batch still costs 3 on nats-server 2.15.1 and takes
  about 3 ms to commit whatever its size (strace of the server, and a 2-message batch against the
  same two publishes: 3.0-3.3 against 0.47-0.54 ms). The sleep-0 ``batch_nosleep`` scenario ran
  10 % faster with 6 % less CPU a rollout without batches at ``interval`` (4 alternating rounds),
  and the same at ``fsync`` (2 rounds), where a batch saves the plain publishes' fsyncs.
* A transport failure (NATS gone, a timeout) fails every command of the batch with
  ``ServiceUnavailableError``; nothing is retried blindly, so nothing is doubled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import PubAck

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.events import AnyEvent, ResourcesPut, encode_event
from eventlight.core.types import generate_id
from eventlight.store.futures import mark_seen
from eventlight.store.jetstream.layout import rollout_filter, subject_for
from eventlight.store.jetstream.nats_errors import WRONG_LAST_SEQUENCE, nats_errors

if TYPE_CHECKING:
    from eventlight.store.jetstream.log import JetStreamEventLog

log = logging.getLogger(__name__)

MAX_BATCH_MESSAGES = 1000
"""nats-server's default ``max_batch_size`` (ADR-50: "each batch can have maximum 1000 messages")."""
PLAIN_WINDOW = 16
"""Plain publishes in flight at once before appends wait to go as a batch (with 4, commands queued
behind one small batch at a time and the micro benchmark slowed at ``fsync``; with 16 it is unchanged)."""
MIN_BATCH_MESSAGES = 5
"""Fewer waiting messages go as concurrent plain publishes: on nats-server 2.15.1 with
``sync_interval: always`` an atomic batch costs 4 fsyncs whatever its size (2 to 200 messages
measured), a plain publish one."""
BATCH_NOT_ENABLED = 10174
"""JetStream error: atomic batch publish not enabled on the stream (``allow_atomic`` off)."""
DUPLICATE_IN_BATCH = 10201
"""JetStream error (nats-server 2.15): a message id of the batch is in the duplicate window already."""


class _Ack(msgspec.Struct):
    """The fields of a JetStream publish ack (or its error) that a batch commit reads."""

    class _Error(msgspec.Struct):
        code: int = 0
        err_code: int = 0
        description: str = ""

    seq: int = 0
    count: int = 0
    duplicate: bool = False
    error: _Error | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)  # a batch's commit
_publish_ack_decoder = msgspec.json.Decoder(_Ack)  # a plain publish (``publish_acked``)


async def publish_acked(
    nc: NATS, subject: str, data: bytes, headers: dict[str, str], timeout_s: float
) -> tuple[int, bool]:
    """Publish to JetStream and wait for the ack: nats-py's ``JetStreamContext.publish``, with the
    ack decoded by msgspec (its ``json.loads`` and ``PubAck`` dataclass cost about 3 µs an ack, this
    0.2 µs; a runner waits for three a rollout). An error answer goes through nats-py's own path.

    Returns:
        The message's stream sequence, and whether the server had its ``Nats-Msg-Id`` already.

    Raises:
        nats.js.errors.APIError: The server refused it (as ``publish`` raises it; ``nats_errors`` maps it).
        nats.js.errors.NoStreamResponseError: No stream takes the subject now (no responders).
        nats.errors.TimeoutError: No ack within ``timeout_s`` seconds.
    """
    try:
        msg = await nc.request(subject, data, timeout=timeout_s, headers=headers)
    except nats.errors.NoRespondersError as e:
        raise nats.js.errors.NoStreamResponseError from e
    try:
        ack = _publish_ack_decoder.decode(msg.data)
    except msgspec.DecodeError:
        ack = None
    if ack is not None and ack.error is None:
        return ack.seq, ack.duplicate
    resp = json.loads(msg.data)  # what ``publish`` does with it: the same error, or the same ack
    if "error" in resp:
        raise nats.js.errors.APIError.from_error(resp["error"])
    pub = PubAck.from_response(resp)
    return pub.seq, bool(pub.duplicate)


@dataclass
class _Append:
    """One command's messages: ``(subject, payload, headers)``; the first carries the fence."""

    key: str | None  # the rollout (never two in one batch); None: unfenced (a worker heartbeat)
    messages: list[tuple[str, bytes, dict[str, str]]]
    resources: str | None = None  # "put": publishes a snapshot; "fenced": fenced on res.> (never together)
    done: asyncio.Future[int] | None = None
    size_bytes: int = 0


@dataclass
class AppendStats:
    """What the appender sent, for tests and benchmarks (counts since the log was opened)."""

    plain_publishes: int = 0
    batches: int = 0
    batch_messages: int = 0
    resubmitted: int = 0


class AtomicAppender:
    """Sends the appends of one event log, combining concurrent ones into atomic batches.

    Args:
        log: The namespace's event log (its connection, JetStream context and server name).
        timeout_s: How long a batch's commit waits for the server's ack.
        max_messages: Messages per batch at most (tests lower it; the server's limit is 1000).
    """

    def __init__(self, log: JetStreamEventLog, *, timeout_s: float, max_messages: int = MAX_BATCH_MESSAGES):
        self.log = log
        self.timeout_s = timeout_s
        self.max_messages = max_messages
        self.stats = AppendStats()
        self.plain_window = PLAIN_WINDOW
        self.min_batch_messages = MIN_BATCH_MESSAGES
        self.batches = log.settings.durability != "interval"
        """Whether concurrent appends may go as atomic batches (not at ``interval``: module docstring)."""
        self._pending: list[_Append] = []
        self._in_flight = 0  # plain publishes sent directly by ``send`` and not answered yet
        self._writer: asyncio.Task[None] | None = None
        self._atomic = True  # False once the stream refused a batch as not enabled

    def command(
        self,
        events: Sequence[AnyEvent],
        expected: int | None,
        command_id: str | None,
        *,
        fence_subject: str | None = None,
    ) -> _Append:
        """The messages of one command, checked against ``max_payload``.

        ``expected`` fences the first event's rollout (``None``: unfenced), or with
        ``fence_subject`` that subject filter instead (a new rollout fenced on the resources);
        ``command_id`` names the messages ``<command_id>:<i>`` for the server's duplicate window
        (``None``: fresh ids).

        Raises:
            InvalidInputError: An event is larger than the server's ``max_payload``.
        """
        limit = self.log.nc.max_payload
        messages: list[tuple[str, bytes, dict[str, str]]] = []
        key: str | None = None
        for i, event in enumerate(events):
            subject = subject_for(self.log.prefix, event)
            data = encode_event(event)
            if limit and len(data) > limit:
                raise InvalidInputError(
                    f"the event for {subject} is {len(data):,} bytes, over the NATS server's max_payload of "
                    f"{limit:,} bytes: store large inputs elsewhere and pass a reference, or split span batches"
                )
            headers = {"Nats-Msg-Id": f"{command_id}:{i}" if command_id else generate_id("", 32)}
            if i == 0 and expected is not None:
                key = subject.split(".")[3]
                headers["Nats-Expected-Last-Subject-Sequence"] = str(expected)
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = fence_subject or rollout_filter(
                    self.log.prefix, key
                )
            messages.append((subject, data, headers))
        resources = "fenced" if fence_subject else ("put" if any(isinstance(e, ResourcesPut) for e in events) else None)
        return _Append(key, messages, resources=resources, size_bytes=sum(len(m[1]) for m in messages))

    async def send(self, request: _Append) -> int:
        """Append ``request``'s messages; the stream sequence of its last one.

        Raises:
            StaleStateError: Its fence is stale.
            ServiceUnavailableError: NATS did not answer.
        """
        if not self.batches or (not self._pending and self._in_flight < self.plain_window):
            self._in_flight += 1
            try:
                return await self._plain(request)
            finally:
                self._in_flight -= 1
        request.done = asyncio.get_running_loop().create_future()
        request.done.add_done_callback(mark_seen)  # a caller cancelled meanwhile never reads its error
        self._pending.append(request)
        if self._writer is None:
            self._writer = asyncio.create_task(self._drain())
        return await asyncio.shield(request.done)

    async def _plain(self, request: _Append) -> int:
        """One command's messages as plain publishes, each after the last (each fenced on the one
        before it, so a command's events stay in order and contiguous per rollout)."""
        seq = 0
        for i, (subject, data, headers) in enumerate(request.messages):
            if i > 0 and request.key is not None:
                headers = {
                    **headers,
                    "Nats-Expected-Last-Subject-Sequence": str(seq),
                    "Nats-Expected-Last-Subject-Sequence-Subject": rollout_filter(self.log.prefix, request.key),
                }
            with nats_errors(self.log.server, f"publish to {subject}"):
                seq, _ = await publish_acked(self.log.nc, subject, data, headers, self.timeout_s)
            self.stats.plain_publishes += 1
        return seq

    def _take(self) -> list[_Append]:
        """The next group: pending requests in order, one per rollout, within the limits."""
        group: list[_Append] = []
        keys: set[str] = set()
        count = size = 0
        limit = self.log.nc.max_payload or (1 << 20)
        rest: list[_Append] = []
        kinds: set[str] = set()  # the resources kinds in the group
        for req in self._pending:
            n = len(req.messages)
            fits = not group or (count + n <= self.max_messages and size + req.size_bytes <= limit)
            if (
                fits
                and (req.key is None or req.key not in keys)
                and not (req.resources and kinds - {req.resources})
                and not rest_blocks(rest, req)
            ):
                group.append(req)
                count += n
                size += req.size_bytes
                if req.key is not None:
                    keys.add(req.key)
                if req.resources:
                    kinds.add(req.resources)
            else:
                rest.append(req)
        self._pending = rest
        return group

    async def _drain(self) -> None:
        """Send the pending requests group by group. Every request taken is answered, whatever
        happens: an unexpected error (an ack that does not decode) fails its group's commands
        with it, and a cancelled writer fails those it had not sent, so no command waits for ever."""
        group: list[_Append] = []
        try:
            while self._pending:
                group = self._take()
                count = sum(len(r.messages) for r in group)
                try:
                    if not self._atomic or count < self.min_batch_messages or count > self.max_messages:
                        await self._alone(group)  # too few to pay for a batch's fsyncs, or one over the limit
                    else:
                        await self._batch(group)
                except Exception as e:
                    log.exception("group commit of %d commands failed", len(group))
                    _fail(group, e)
        finally:
            self._writer = None
            left = [r for r in group if r.done is not None and not r.done.done()] + self._pending
            if left:  # only when the writer itself was cancelled
                self._pending = []
                _fail(left, ServiceUnavailableError(self.log.server(), "the event log's writer stopped (cancelled)"))

    async def _settle(self, request: _Append, sending: Awaitable[int]) -> None:
        assert request.done is not None
        try:
            seq = await sending
        except Exception as e:
            if not request.done.done():
                request.done.set_exception(e)
            return
        if not request.done.done():
            request.done.set_result(seq)

    async def _alone(self, group: list[_Append]) -> None:
        """Each command of ``group`` as plain publishes, concurrently: each gets its own answer."""
        await asyncio.gather(*(self._settle(req, self._plain(req)) for req in group))

    async def _resubmit(self, group: list[_Append]) -> None:
        """A refused batch's commands, each alone (see ``_alone``)."""
        self.stats.resubmitted += len(group)
        await self._alone(group)

    async def _batch(self, group: list[_Append]) -> None:
        """Send ``group`` as one atomic batch and answer each command with its last sequence."""
        batch_id = uuid.uuid4().hex
        flat = [(subject, data, headers) for req in group for subject, data, headers in req.messages]
        nc = self.log.nc
        try:
            with nats_errors(self.log.server, f"atomic batch of {len(flat)} messages to {self.log.stream}"):
                for i, (subject, data, headers) in enumerate(flat, 1):
                    batch = dict(headers)
                    batch["Nats-Batch-Id"] = batch_id
                    batch["Nats-Batch-Sequence"] = str(i)
                    if i < len(flat):
                        await nc.publish(subject, data, headers=batch)
                        continue
                    batch["Nats-Batch-Commit"] = "1"
                    reply = await nc.request(subject, data, timeout=self.timeout_s, headers=batch)
        except Exception as e:
            for req in group:
                assert req.done is not None
                if not req.done.done():
                    req.done.set_exception(e)
            return
        try:
            ack = _ack_decoder.decode(reply.data)
        except msgspec.DecodeError:  # the batch may or may not be stored: never resubmitted blindly
            unreadable = ServiceUnavailableError(
                self.log.server(), f"the commit of an atomic batch was answered with {reply.data[:200]!r}, not an ack"
            )
            _fail(group, unreadable)
            return
        if ack.error is not None:
            if ack.error.err_code not in (WRONG_LAST_SEQUENCE, DUPLICATE_IN_BATCH):
                self._refused(ack.error.err_code, ack.error.description)
            await self._resubmit(group)
            return
        self.stats.batches += 1
        self.stats.batch_messages += len(flat)
        seq = ack.seq - len(flat)
        for req in group:
            seq += len(req.messages)
            assert req.done is not None
            if not req.done.done():
                req.done.set_result(seq)

    def _refused(self, err_code: int, description: str) -> None:
        if err_code == BATCH_NOT_ENABLED:
            self._atomic = False
        log.warning(
            "%s refused an atomic batch (%d: %s); its commands sent one by one", self.log.stream, err_code, description
        )


def _fail(requests: list[_Append], error: BaseException) -> None:
    """Answer each unanswered request of ``requests`` with ``error``."""
    for req in requests:
        if req.done is not None and not req.done.done():
            req.done.set_exception(error)


def rest_blocks(rest: list[_Append], request: _Append) -> bool:
    """Whether an earlier request left for later has ``request``'s rollout (order per rollout), or
    is a resources snapshot where ``request`` is fenced on the resources, or the other way round
    (a batch checks every fence against the stream before it, so a create fenced on the resources
    after a snapshot in the same batch would pass and name the older one)."""
    if request.key is not None and any(r.key == request.key for r in rest):
        return True
    return request.resources is not None and any(r.resources not in (None, request.resources) for r in rest)
