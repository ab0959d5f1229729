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
from collections.abc import Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.events import RolloutCreated, decode_event
from eventlight.store.jetstream.connect import on_reconnected
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
STREAM_INFO_TIMEOUT_S = 10.0
WITHDRAWN_GRACE_S = 1.0  # how long a withdrawn request's inbox still hands back what comes (see _abandon)
HAND_BACK_ANSWER_S = 10.0  # how long a hand-back waits for the server to confirm it (see ``hand_back``)
MAX_IDLE_INBOXES = 64  # idle pull inboxes kept for the next pulls; more are unsubscribed (see _pool)


class _StreamTimes(msgspec.Struct):
    """What ``_last_write_age`` reads of a ``STREAM.INFO`` answer (RFC 3339 times, server clock)."""

    class _State(msgspec.Struct):
        last_ts: datetime | None = None

    ts: datetime | None = None
    state: _State | None = None


_stream_times_decoder = msgspec.json.Decoder(_StreamTimes)


class JetStreamQueued:
    """One delivered queue message (see ``eventlight.store.ports.Queued``); ``queue``: the one that
    pulled it, which hands it back (``nak``)."""

    def __init__(self, msg: Any, queue: RunnersQueue):
        self.msg = msg
        self.queue = queue
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
        """Offer it again after ``delay_s`` seconds (``RunnersQueue.hand_back``).

        Raises:
            ServiceUnavailableError: NATS did not take it (or, for ``0``, did not confirm it).
        """
        await self.queue.hand_back(self.msg, delay_s)

    async def in_progress(self) -> None:
        await self.msg.in_progress()


class RunnersQueue:
    """Pulls from the ``runners`` consumer of one namespace's stream."""

    def __init__(self, log: JetStreamEventLog):
        self.log = log
        self._sub: Any = None
        self._inboxes: list[_Inbox] = []  # idle, for the next pull
        self._all: set[_Inbox] = set()  # every inbox subscribed
        self._abandoned: set[_Inbox] = set()  # inboxes of pulls nobody waits for, not yet answered
        self._background: set[asyncio.Future[None]] = set()  # hand-backs and unsubscribes under way
        self._full = False  # found full: non-blocking pulls ask the consumer first, until it is not
        self._found_empty = False  # the last non-blocking pull found nothing (see ``_pull``)
        self._long_polls: set[_Inbox] = set()  # inboxes of long polls waited for (see ``_reconnected``)
        self._reconnects = 0  # how often the connection came back (see ``_reconnected``)
        self._unhook = on_reconnected(log.nc, self._reconnected)

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
            clock = asyncio.get_running_loop().time
            deadline = clock() + wait_s
            while True:
                left = max(0.05, deadline - clock())
                expires = max(1, int(left * 1e9))
                msg = await self._pull_request(
                    f'{{"batch":1,"expires":{expires}}}'.encode(), timeout_s=left + LONG_POLL_MARGIN_S, long_poll=True
                )
                if msg is not _LOST:
                    break
        return JetStreamQueued(msg, self) if msg is not None else None

    def _reconnected(self) -> None:
        """The connection is back after it was lost (``on_reconnected``): the long polls waited
        for are sent again, for the rest of their wait. The requests they had sent are gone if
        the server restarted or dropped the connection, and nothing would tell: each waited out
        its whole ``wait_s`` (and ``LONG_POLL_MARGIN_S``), then failed, while entries enqueued
        since sat in the queue (10 live 8 s polls, nats-server killed and restarted: all 10 failed
        10.6 s after 5 rollouts were enqueued, the 5 still queued)."""
        self._reconnects += 1
        for inbox in self._long_polls:
            if inbox.waiter is not None:
                _wake(inbox.waiter)

    async def hand_back(self, msg: Any, delay_s: float) -> None:
        """Hand a delivered entry back (``-NAK``): offered again after ``delay_s`` seconds.

        For ``0`` (at once), the ``-NAK`` is sent as a request and this returns once the server
        answers it, which it does after it has put the entry on the consumer's redelivery queue
        (nats-server's ``processAck``: "ack the ack if requested"). A ``no_wait`` pull sent after
        this returns finds the entry: the server answers such a pull from its count of pending and
        redelivery-queued messages, and a ``-NAK`` published without a reply (nats-py's
        ``msg.nak()``) is taken in the server's own time, on another goroutine than pulls, so a
        pull that left in the same write could be told "no messages" (5 dequeues in 100 under
        load; the empty answer's ``STREAM.INFO`` confirmation sees stream writes, not naks). The
        round trip is paid by hand-backs only, never by a pull. A delayed hand-back is published
        without an answer: the entry is not offered before its delay anyway.

        Args:
            msg: The entry as nats-py delivered it (``JetStreamQueued.msg``).
            delay_s: Seconds before it is offered again (``0``: at once).

        Raises:
            ServiceUnavailableError: NATS did not take it, or did not confirm a ``0`` one in
                ``HAND_BACK_ANSWER_S`` seconds.
        """
        with nats_errors(self.log.server, "handing back a queue entry"):
            if delay_s > 0:
                await msg.nak(delay=delay_s)
                return
            inbox = await self._send(msg.reply, b"-NAK", HAND_BACK_ANSWER_S)
            await self._receive(inbox, HAND_BACK_ANSWER_S)

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
        asked = await self._ask_last_write() if self._found_empty else None
        try:
            msg = await self._pull_request(b'{"batch":1,"no_wait":true}', probe_full=True)
        except BaseException:
            if asked is not None:
                self._give_up(asked)
            raise
        self._found_empty = msg is None
        if msg is not None:
            if asked is not None:
                self._give_up(asked)  # its answer goes unread
            return msg
        age = await self._last_write_age(asked)
        # the empty answer came at most `elapsed` before the age was read
        wait = EMPTY_CONFIRM_S if age is None else EMPTY_CONFIRM_S - age + (time.monotonic() - started)
        if wait <= 0:
            return None
        wait = min(wait, EMPTY_CONFIRM_S)
        return await self._pull_request(f'{{"batch":1,"expires":{max(1, int(wait * 1e9))}}}'.encode())

    async def _ask_last_write(self) -> _Inbox:
        """Send the ``STREAM.INFO`` request ``_last_write_age`` reads the answer of.

        Raises:
            ServiceUnavailableError: NATS did not take it.
        """
        with nats_errors(self.log.server, "stream info"):
            return await self._send(f"$JS.API.STREAM.INFO.{self.log.stream}", b"", STREAM_INFO_TIMEOUT_S)

    async def _last_write_age(self, asked: _Inbox | None = None) -> float | None:
        """Seconds since the stream's last message by the server's own clock (``STREAM.INFO``'s
        ``ts`` and ``state.last_ts``; nats-server >= 2.10), or ``None`` when the answer lacks them.
        ``asked``: the request already sent (``_ask_last_write``), else it is sent now.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        if asked is None:
            asked = await self._ask_last_write()
        with nats_errors(self.log.server, "stream info"):
            reply = await self._receive(asked, STREAM_INFO_TIMEOUT_S)
            if (reply.headers or {}).get("Status") == "503":
                raise nats.errors.NoRespondersError
        try:
            info = _stream_times_decoder.decode(reply.data)
        except msgspec.DecodeError:  # includes ValidationError: an error answer, another server
            return None
        if info.ts is None or info.state is None or info.state.last_ts is None:
            return None
        return (info.ts - info.state.last_ts).total_seconds()

    async def _pull_request(
        self, request: bytes, timeout_s: float | None = None, probe_full: bool = False, long_poll: bool = False
    ) -> Any:
        """One pull request; JetStream delivers the message under its own subject, so each request
        needs an inbox of its own (``_Inbox``: idle ones are kept for the next call, and an inbox
        serves one request at a time). ``None`` when the server answers that there is nothing
        (404, or 408 when the request expires), or when it does not answer in ``timeout_s``
        (default ``NO_WAIT_ANSWER_S``) because the consumer is at its ``max_ack_pending``
        (``_at_max_ack_pending``). With ``probe_full`` (a ``no_wait`` pull, which answers in a
        round trip unless the consumer is full), that is asked once the pull has waited
        ``FULL_PROBE_S``; a full consumer answers ``None`` then. A request whose caller stopped
        waiting for it (cancelled, timed out, found the consumer full) is withdrawn from the
        server, and an entry already on its way is handed back at once (``_abandon``). A
        ``long_poll`` still waiting when the connection comes back after it was lost answers
        ``_LOST``: its request is withdrawn, to be sent again (``_reconnected``).

        The wait costs one future and one timer: the inbox's callback keeps the answer and wakes
        the caller (before, nats-py's ``next_msg`` in a task of its own, shielded, made two tasks
        and a ``wait_for`` a pull).

        Raises:
            ServiceUnavailableError: No answer in ``timeout_s`` seconds, a transport error, or
                another status (409: the consumer is gone or has too many waiting requests; ``409
                Server Shutdown``, the server stopping in order, with ``shutting_down`` set).
        """
        timeout_s = NO_WAIT_ANSWER_S if timeout_s is None else timeout_s
        inbox = self._inboxes.pop() if self._inboxes else await self._new_inbox()
        loop = asyncio.get_running_loop()
        probe = probe_full and timeout_s > FULL_PROBE_S
        waiter = inbox.begin(loop, FULL_PROBE_S if probe else timeout_s)
        reconnects = self._reconnects
        try:
            await self.log.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{self.log.stream}.runners", request, reply=inbox.subject
            )
            if long_poll:
                self._long_polls.add(inbox)
                try:
                    await waiter
                finally:
                    self._long_polls.discard(inbox)
                if inbox.answer is None and self._reconnects != reconnects and inbox.sub is not None:
                    self._abandon(inbox)
                    return _LOST
            else:
                await waiter
            if inbox.answer is None and probe:
                if await self._at_max_ack_pending() and inbox.answer is None:
                    self._abandon(inbox)
                    return None
                await inbox.rewait(loop, timeout_s - FULL_PROBE_S)
            if inbox.answer is None:
                raise inbox.no_answer()
        except TRANSPORT_ERRORS as e:
            self._give_up(inbox)  # the request is withdrawn, and an entry on its way handed back
            if isinstance(e, nats.errors.TimeoutError) and await self._at_max_ack_pending():
                return None  # nothing claimable until a claim finishes
            raise ServiceUnavailableError(self.log.server(), f"pull from the runners queue failed: {e!r}") from e
        except BaseException:
            # Cancelled: left at the server, the request would hold one of the consumer's
            # ``max_waiting`` places until it expires, and take entries nobody waits for.
            self._give_up(inbox)
            raise
        msg = self._answered(inbox)
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

    async def _send(self, subject: str, payload: bytes, timeout_s: float) -> _Inbox:
        """Send a request answered on one of the pull inboxes; ``_receive`` waits for the answer.
        ``nc.request`` without nats-py's ``wait_for`` and random token a request, and without a
        task where the answer is waited for after another request's.

        Raises:
            nats.errors.Error: nats-py's transport errors.
        """
        inbox = self._inboxes.pop() if self._inboxes else await self._new_inbox()
        inbox.begin(asyncio.get_running_loop(), timeout_s)
        try:
            await self.log.nc.publish(subject, payload, reply=inbox.subject)
        except BaseException:
            self._give_up(inbox)
            raise
        return inbox

    async def _receive(self, inbox: _Inbox, timeout_s: float) -> Any:
        """The answer to ``inbox``'s request (``_send``).

        Raises:
            nats.errors.TimeoutError: No answer in ``timeout_s`` seconds from the send.
        """
        try:
            if inbox.waiter is not None:
                await inbox.waiter
            if inbox.answer is None:
                raise inbox.no_answer()
        except BaseException:
            self._give_up(inbox)
            raise
        return self._answered(inbox)

    def _answered(self, inbox: _Inbox) -> Any:
        """The answer ``inbox`` brought; the inbox goes back to the pool."""
        msg = inbox.answer
        inbox.idle()
        self._pool(inbox)
        return msg

    def _pool(self, inbox: _Inbox) -> None:
        """An idle inbox is kept for the next request, unless ``close`` unsubscribed it, or
        ``MAX_IDLE_INBOXES`` are kept already: each is a subscription with a task of its own in
        nats-py, and a burst of concurrent pulls (1,000 dequeues at once: 2,000 inboxes, a pull and
        its ``STREAM.INFO`` each) would otherwise keep them all for as long as the store is open."""
        if inbox.sub is None:
            return
        if len(self._inboxes) < MAX_IDLE_INBOXES:
            self._inboxes.append(inbox)
            return
        self._all.discard(inbox)
        inbox.unsubscribe_later()

    async def _new_inbox(self) -> _Inbox:
        inbox = _Inbox(self)
        nc = self.log.nc
        with nats_errors(self.log.server, "subscribing a pull inbox"):
            inbox.sub = await nc.subscribe(inbox.subject_from(nc.new_inbox()), cb=inbox.deliver)
        self._all.add(inbox)
        return inbox

    def _give_up(self, inbox: _Inbox) -> None:
        """The caller of ``inbox``'s request stops waiting: hand back the entry it brought, or
        withdraw the request (``_abandon``)."""
        msg = inbox.answer
        if msg is None:
            self._abandon(inbox)
            return
        inbox.idle()
        self._pool(inbox)
        if _is_entry(msg):
            self._in_background(_nak(msg))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abandon(self, inbox: _Inbox) -> None:
        """Nobody waits for ``inbox``'s answer any more: its request is withdrawn from the server,
        and the inbox never reused. nats-server drops a waiting pull request whose reply subject
        has lost its interest rather than deliver to it (``consumer.go``: ``nextWaiting`` skips it,
        ``processWaiting`` removes it when ``max_waiting`` is reached, and ``CONSUMER.INFO``'s
        ``num_waiting`` leaves it out), so the inbox's ``UNSUB`` is sent at once
        (``_drop_interest``). Its callback stays ``WITHDRAWN_GRACE_S`` more, and hands back an
        entry that comes meanwhile, sent before the server took the ``UNSUB`` (``_Inbox.deliver``);
        then the inbox is unsubscribed. Only an entry the consumer picked this request for just
        before the ``UNSUB``, but had not yet routed to the connection, is dropped by the server
        and comes back after the consumer's ack wait. One that ``close`` unsubscribed can bring
        nothing more.

        Kept subscribed until the request expired, as before, a cancelled long poll held one of
        the consumer's ``max_waiting`` (512) places for its whole ``wait_s``: of 2,000 cancelled
        3 s polls in a row, 779-1,303 were refused (409 "Exceeded MaxWaiting"; 5 runs), and a
        rollout enqueued right after went to each abandoned request in turn (431-512 of them),
        handed back by each, before a live pull got it 0.23-0.84 s later; a non-blocking dequeue
        found nothing. Withdrawn: no 409, no hand-back, delivered once, to the first dequeue."""
        if inbox.sub is None:
            inbox.idle()
            return
        inbox.abandon(asyncio.get_running_loop())
        self._abandoned.add(inbox)

    def _settled(self, inbox: _Inbox) -> None:
        """``inbox``'s abandoned request is withdrawn (``_abandon``): the inbox is gone."""
        self._abandoned.discard(inbox)
        self._all.discard(inbox)

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

    async def close(self) -> None:
        """Unsubscribe; idempotent. Pulls of cancelled dequeues get ``HAND_BACK_CLOSE_WAIT_S`` to
        hand back an entry already on its way; a pull still waited for fails
        (``ServiceUnavailableError``, as when the connection closes under it)."""
        self._unhook()
        waits = [i.settled for i in self._abandoned if i.settled is not None] + list(self._background)
        if waits:
            await asyncio.wait(waits, timeout=HAND_BACK_CLOSE_WAIT_S)
        sub, self._sub = self._sub, None
        inboxes, self._all, self._inboxes = self._all, set(), []
        self._abandoned.clear()
        for inbox in inboxes:
            inbox.close()
        for task in list(self._background):
            task.cancel()
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


_LOST = object()
"""What ``_pull_request`` answers for a long poll whose request the lost connection took with it."""


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _is_entry(msg: Any) -> bool:
    """Whether an answer is a queue entry: not a pull's status (404, 408, 409), nor a ``STREAM.INFO``."""
    return bool(msg.reply) and (msg.headers or {}).get("Status") is None


async def _nak(msg: Any) -> None:
    """Hand a delivered entry back: negatively acknowledged without delay, it is redelivered at once."""
    with contextlib.suppress(Exception):  # the connection went: it comes back after the ack wait
        await msg.nak()
        log.info("handed back queue entry %s of a pull nobody waited for", msg.subject)


class _Inbox:
    """The reply subject of one pull request at a time: a subscription whose callback keeps the
    answer for the caller waiting on it (``begin``), or hands back an entry nobody waits for: its
    caller gave up (``abandon``), or an answer the inbox was not waiting for."""

    __slots__ = ("answer", "queue", "settled", "sub", "subject", "timer", "waiter")

    def __init__(self, queue: RunnersQueue):
        self.queue = queue
        self.sub: Any = None
        self.subject = ""
        self.answer: Any = None  # the answer to the pull in flight, once it came
        self.waiter: asyncio.Future[None] | None = None  # woken by the answer (or the caller's timer)
        self.settled: asyncio.Future[None] | None = None  # while abandoned: done once it is withdrawn
        self.timer: asyncio.TimerHandle | None = None  # wakes the waiter without an answer

    def subject_from(self, subject: str) -> str:
        self.subject = subject
        return subject

    def begin(self, loop: asyncio.AbstractEventLoop, wait_s: float) -> asyncio.Future[None]:
        """A request goes out: its waiter wakes on the answer, or after ``wait_s`` seconds."""
        self.answer = None
        waiter = self.waiter = loop.create_future()
        if self.sub is None:  # closed (``close``): no answer can come
            waiter.set_result(None)
        else:
            self.timer = loop.call_later(wait_s, _wake, waiter)
        return waiter

    def rewait(self, loop: asyncio.AbstractEventLoop, wait_s: float) -> asyncio.Future[None]:
        """A new waiter for the same request (the first one woke up without an answer)."""
        waiter = self.waiter = loop.create_future()
        if self.answer is not None or self.sub is None:
            waiter.set_result(None)
        else:
            self.timer = loop.call_later(wait_s, _wake, waiter)
        return waiter

    def no_answer(self) -> nats.errors.Error:
        """What a request woken without an answer fails with: its wait ran out, or ``close``."""
        return nats.errors.ConnectionClosedError() if self.sub is None else nats.errors.TimeoutError()

    def idle(self) -> None:
        self.answer = self.waiter = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Withdraw the request nobody waits for (``RunnersQueue._abandon``), in the background;
        ``settled`` is done once it is."""
        self.idle()
        self.settled = loop.create_future()
        self.queue._in_background(self._withdraw())

    async def _withdraw(self) -> None:
        try:
            if self.sub is not None:
                with contextlib.suppress(Exception):  # the connection went: nothing more can come
                    await _drop_interest(self.queue.log.nc, self.sub)
                await asyncio.sleep(WITHDRAWN_GRACE_S)
        finally:
            self.unsubscribe_later()
            self._settle()

    async def deliver(self, msg: Any) -> None:
        """The subscription's callback (run by nats-py's task of this subscription)."""
        if self.settled is None and self.waiter is not None and self.answer is None:
            self.answer = msg
            if not self.waiter.done():
                self.waiter.set_result(None)
            return
        if _is_entry(msg):
            await _nak(msg)

    def _settle(self) -> None:
        settled, self.settled = self.settled, None
        if settled is None:
            return
        settled.set_result(None)
        self.queue._settled(self)

    def close(self) -> None:
        """Unsubscribe; a caller still waiting fails as if the connection had closed (``no_answer``).
        Its waiter is woken, not failed: a request sent and not yet waited for (``_send``), whose
        caller then gives up on it, would leave an exception nobody retrieves."""
        self.unsubscribe_later()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.waiter is not None:
            _wake(self.waiter)

    def unsubscribe_later(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            self.queue._in_background(_unsubscribe(sub))


async def _drop_interest(nc: Any, sub: Any) -> None:
    """Send the server ``sub``'s ``UNSUB`` while nats-py goes on delivering to its callback what
    still comes on it (nats-py 2.16's ``Client._send_unsubscribe``: no public call does this).
    nats-py's ``unsubscribe`` forgets the subscription at once, and its ``drain`` after a ``PING``
    round trip, but JetStream writes a delivery to the connection after the consumer has picked
    the request, on another goroutine than the one that answers the ``PING``: with ``drain``, a
    storm of cancelled non-blocking dequeues left an entry to the ack wait in 2 seeds of 6.

    Raises:
        nats.errors.Error: nats-py's transport errors.
    """
    await nc._send_unsubscribe(sub._id, limit=0)


async def _unsubscribe(sub: Any) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
