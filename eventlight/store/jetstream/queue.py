"""The runners' work queue: the durable pull consumer ``runners`` on ``el.<ns>.r.*.q``.

``next(wait_s)`` hands out one queue entry; the one store claims it by appending
``AttemptStarted`` expecting the entry's sequence (``EventStore._claim``), so two deliveries can
never create two attempts. The message stays in progress (heartbeats extend it) until the attempt
finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.events import RolloutCreated, decode_event
from eventlight.store.futures import mark_seen, wait_done
from eventlight.store.jetstream.definitions import consumer_config
from eventlight.store.jetstream.layout import rollout_of_subject
from eventlight.store.jetstream.nats_errors import TRANSPORT_ERRORS, nats_errors

if TYPE_CHECKING:
    from eventlight.store.jetstream.log import JetStreamEventLog

log = logging.getLogger(__name__)

HAND_BACK_CLOSE_WAIT_S = 0.5  # how long close lets cancelled pulls hand back an entry in flight
FULL_PROBE_S = 0.5  # a no_wait pull unanswered this long asks whether the consumer is full (see _pull_request)
NO_WAIT_ANSWER_S = 10.0  # how long a no_wait pull may take to answer before the server counts as down
LONG_POLL_MARGIN_S = 5.0  # how much longer than its expiry a long poll waits for the server's answer
EMPTY_CONFIRM_S = 0.010  # how long after a write a non-blocking dequeue waits for the consumer (see _pull)


class _StreamTimes(msgspec.Struct):
    """What ``_last_write_age`` reads of a ``STREAM.INFO`` answer (RFC 3339 times, server clock)."""

    class _State(msgspec.Struct):
        last_ts: datetime | None = None

    ts: datetime | None = None
    state: _State | None = None


_stream_times_decoder = msgspec.json.Decoder(_StreamTimes)


class JetStreamQueued:
    """One delivered queue message (see ``eventlight.store.ports.Queued``)."""

    def __init__(self, msg: Any):
        self.msg = msg
        self.rollout_id = rollout_of_subject(msg.subject)
        self.seq: int = msg.metadata.sequence.stream
        self.redelivered = (msg.metadata.num_delivered or 1) > 1
        try:
            event = decode_event(msg.data)
        except InvalidInputError:
            event = None  # the claim loads the rollout instead
        self.created = RolloutState(rollout=event.rollout) if isinstance(event, RolloutCreated) else None

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay_s: float) -> None:
        await self.msg.nak(delay=delay_s)

    async def in_progress(self) -> None:
        await self.msg.in_progress()


class RunnersQueue:
    """Pulls from the ``runners`` consumer of one namespace's stream."""

    def __init__(self, log: JetStreamEventLog):
        self.log = log
        self._sub: Any = None
        self._inboxes: list[Any] = []
        self._abandoned: set[asyncio.Task[None]] = set()  # inboxes of cancelled pulls, being settled
        self._full = False  # found full: non-blocking pulls ask the consumer first, until it is not
        self._found_empty = False  # the last non-blocking pull found nothing (see ``_pull``)

    async def _subscription(self) -> Any:
        if self._sub is None:
            subject = f"{self.log.prefix}.r.*.q"
            cfg = consumer_config("runners", self.log.settings.namespace)  # streams/002_runners.json
            with nats_errors(self.log.server, "subscribing to the runners queue"):
                self._sub = await self.log.js.pull_subscribe(
                    subject, durable="runners", stream=self.log.stream, config=cfg
                )
        return self._sub

    async def next(self, wait_s: float) -> JetStreamQueued | None:
        """The next queue entry, waiting up to ``wait_s`` seconds (``0``: see ``_pull``).

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        await self._subscription()  # creates or updates the durable consumer
        if wait_s <= 0:
            msg = await self._pull()
        else:
            # A pull request of its own, not nats-py's ``fetch``: concurrent fetches on one pull
            # subscription share its inbox, so one caller can take another's message or timeout
            # status (several runners share a store in one process, ``RunnerPool(runners_per_process)``).
            expires = max(1, int(max(0.05, wait_s) * 1e9))
            msg = await self._pull_request(
                f'{{"batch":1,"expires":{expires}}}'.encode(), timeout_s=wait_s + LONG_POLL_MARGIN_S
            )
        return JetStreamQueued(msg) if msg is not None else None

    async def _pull(self) -> Any:
        """The next message, or ``None`` if the queue is empty, without nats-py's 50 ms minimum wait.

        A ``no_wait`` pull answers at once, but from the consumer's own count of pending messages,
        which the server updates asynchronously after a publish is acknowledged: right after an
        enqueue (by any process) it can still say "no messages" (seen about once in 300 tries on a
        loaded machine; the rollout was visible 0.7-7.5 ms after its ack). So an empty answer stands
        only if the stream has had no write in the ``EMPTY_CONFIRM_S`` before it, by the server's
        clock (``_last_write_age``, one ``STREAM.INFO``); otherwise a pull that waits out the rest
        of that time confirms it. After an empty answer, the next pull's ``STREAM.INFO`` leaves with
        it (one write, both answers in one round trip; the info only serves if the pull finds
        nothing again): a poller of an empty queue waits one round trip a dequeue while the stream
        is quiet, and about ``EMPTY_CONFIRM_S`` more right after any write to the namespace's
        stream, not only a queue write. (Sent together, the info can be read just before the pull
        is answered; it still sees every write acknowledged before the dequeue began, which is what
        the empty answer must account for.) Runners long-poll (``wait_s > 0``), which never takes
        this path.
        """
        started = time.monotonic()
        if self._full and await self._at_max_ack_pending():
            return None  # still full: asked in one round trip instead of a pull left unanswered
        info = asyncio.ensure_future(self._last_write_age()) if self._found_empty else None
        if info is not None:
            info.add_done_callback(mark_seen)  # unread when the pull brings a message
        try:
            msg = await self._pull_request(b'{"batch":1,"no_wait":true}', probe_full=True)
        except BaseException:
            if info is not None:
                info.cancel()
            raise
        self._found_empty = msg is None
        if msg is not None:
            return msg
        age = await (info if info is not None else self._last_write_age())
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
        with nats_errors(self.log.server, "stream info"):
            reply = await self.log.nc.request(f"$JS.API.STREAM.INFO.{self.log.stream}", b"", timeout=10.0)
        try:
            info = _stream_times_decoder.decode(reply.data)
        except msgspec.DecodeError:  # includes ValidationError: an error answer, another server
            return None
        if info.ts is None or info.state is None or info.state.last_ts is None:
            return None
        return (info.ts - info.state.last_ts).total_seconds()

    async def _pull_request(self, request: bytes, timeout_s: float | None = None, probe_full: bool = False) -> Any:
        """One pull request; JetStream delivers the message under its own subject, so each request
        needs an inbox of its own (idle inbox subscriptions are kept for the next call). ``None``
        when the server answers that there is nothing (404, or 408 when the request expires), or
        when it does not answer in ``timeout_s`` (default ``NO_WAIT_ANSWER_S``) because the
        consumer is at its ``max_ack_pending`` (``_at_max_ack_pending``). With ``probe_full`` (a
        ``no_wait`` pull, which answers in a round trip unless the consumer is full), that is asked
        once the pull has waited ``FULL_PROBE_S``; a full consumer answers ``None`` then, and an
        entry the request still brings later is handed back (``_hand_back``).

        Raises:
            ServiceUnavailableError: No answer in ``timeout_s`` seconds, a transport error, or
                another status (409: the consumer is gone or has too many waiting requests; ``409
                Server Shutdown``, the server stopping in order, with ``shutting_down`` set).
        """
        timeout_s = NO_WAIT_ANSWER_S if timeout_s is None else timeout_s
        nc = self.log.nc
        inbox = self._inboxes.pop() if self._inboxes else await nc.subscribe(nc.new_inbox())
        answer: asyncio.Future[Any] | None = None
        try:
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.log.stream}.runners", request, reply=inbox.subject)
            # A task of its own, shielded: nats-py's ``next_msg`` takes the message off the inbox in
            # a child task, so cancelling it at the wrong moment would drop a delivered entry.
            answer = asyncio.ensure_future(inbox.next_msg(timeout=timeout_s))
            if probe_full:
                if not await wait_done(answer, FULL_PROBE_S) and await self._at_max_ack_pending():
                    self._settle_later(inbox, answer)
                    return None
            msg = await asyncio.shield(answer)
        except TRANSPORT_ERRORS as e:
            with contextlib.suppress(Exception):
                await inbox.unsubscribe()  # a late answer must not reach the next caller
            if isinstance(e, nats.errors.TimeoutError) and await self._at_max_ack_pending():
                return None  # nothing claimable until a claim finishes
            raise ServiceUnavailableError(self.log.server(), f"pull from the runners queue failed: {e!r}") from e
        except asyncio.CancelledError:
            # The request stays at the server until it expires: an entry it delivers now would wait
            # out the consumer's ack wait (30 s) before another runner got it. Hand it back at once.
            if answer is None:
                answer = asyncio.ensure_future(inbox.next_msg(timeout=timeout_s))
            self._settle_later(inbox, answer)
            raise
        self._inboxes.append(inbox)
        status = (msg.headers or {}).get("Status")
        if status in ("404", "408"):
            return None
        if status is not None:
            shutdown = status == "409" and (msg.headers or {}).get("Description") == "Server Shutdown"
            raise ServiceUnavailableError(
                self.log.server(),
                f"pull from the runners queue answered {status} {msg.headers}",
                shutting_down=shutdown,
            )
        return msg

    def _settle_later(self, inbox: Any, answer: asyncio.Future[Any]) -> None:
        """Leave a pull nobody waits for to ``_hand_back`` (``close`` waits a little for it)."""
        task = asyncio.ensure_future(self._hand_back(inbox, answer))
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)

    async def _at_max_ack_pending(self) -> bool:
        """Whether the ``runners`` consumer holds as many unacknowledged claims as it allows
        (``max_ack_pending``, ``streams/002_runners.json``): nats-server then leaves a ``no_wait``
        pull unanswered instead of saying so (2.15.1). Logs a warning when it becomes full; from
        then until it is found not full, non-blocking dequeues ask this first."""
        try:
            with nats_errors(self.log.server, "consumer info"):
                info = await self.log.js.consumer_info(self.log.stream, "runners")
        except ServiceUnavailableError:
            return False
        limit, pending = info.config.max_ack_pending or 0, info.num_ack_pending or 0
        if limit <= 0 or pending < limit:
            self._full = False
            return False
        was_full, self._full = self._full, True
        if was_full:
            return True
        log.warning(
            "the runners queue holds %d claims not yet finished, its max_ack_pending: nothing more can be "
            "claimed until attempts finish (or their claims time out)",
            pending,
        )
        return True

    async def _hand_back(self, inbox: Any, answer: asyncio.Future[Any]) -> None:
        """Wait for the answer to a pull whose caller was cancelled; a queue entry it brings is
        negatively acknowledged without delay, so it is redelivered at once."""
        try:
            msg = await answer
            if (msg.headers or {}).get("Status") is None:
                await msg.nak()
                log.info("handed back queue entry %s of a cancelled dequeue", msg.subject)
        except Exception:  # no answer, or the connection went: the entry (if any) comes back after the ack wait
            pass
        finally:
            answer.cancel()
            with contextlib.suppress(Exception):
                await inbox.unsubscribe()

    async def close(self) -> None:
        """Unsubscribe; idempotent. Pulls of cancelled dequeues get ``HAND_BACK_CLOSE_WAIT_S`` to
        hand back an entry already on its way."""
        if self._abandoned:
            await asyncio.wait(set(self._abandoned), timeout=HAND_BACK_CLOSE_WAIT_S)
        for task in list(self._abandoned):
            task.cancel()
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
