"""``Subscription``: finished attempts as an async iterator, from a durable or ephemeral feed.

Delivery semantics (both backends):

* **In order, each attempt once.** Records come in log order of the events that finished them
  (``FinishedAttempt.position`` increases); a subscription never yields an attempt twice.
  (``collect`` alone may return an attempt iteration met before, once more: the latest attempt of
  a rollout ended later by an event that finished no attempt, such as a cancel in the queue; and
  it returns what the previous ``collect`` returned again when asked for it again. It also
  returns, at once, the result of a rollout that ended before the feed's first position, read
  from the log, which iteration never yields.)
* **Acknowledged when you ask for the next one.** The record in hand is acknowledged (cumulatively,
  confirmed by the server) when the iterator is asked for the following record, by ``ack()``, or by
  leaving ``async with`` without an exception. A durable subscription opened again under the same
  name resumes right after the last acknowledged record: nothing acknowledged comes again, nothing
  after it is skipped (no gap, no repeat of what was acknowledged).
* **At least once for the record in hand.** A subscriber that dies (kill -9) or closes with a record
  in hand, not acknowledged, gets that record again on resuming, with ``redelivered=True`` and the
  same ``position``: a consumer that stores the last position with its own effects drops it
  (``record.position <= last``), which makes the effect exactly-once. Only the first record(s)
  after a resume (those of one position) can be flagged: events the feed had pulled ahead of the
  record in hand were never yielded, and come unflagged.

The iterator can be cancelled (``asyncio.timeout``) without losing a delivery: a pending pull is
awaited again by the next call, and a fold step changes nothing until it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from eventlight.core.errors import InvalidInputError, RolloutNotFoundError
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, Rollout
from eventlight.logreplay.records import AdapterFn
from eventlight.logreplay.select import Filters
from eventlight.store.futures import cancels, raise_if_cancelled
from eventlight.store.ports import Delivery, EventLog, Feed
from eventlight.store.subscription.fold import FollowFold, RolloutEnded
from eventlight.store.subscription.records import FinishedAttempt, SubscriptionError

log = logging.getLogger(__name__)

PULL_WAIT_S = 1.0
MAX_STASH = 100_000
READS_AT_ONCE = 32
"""How many rollouts ``collect`` reads from the log at once to find those that ended before the
feed's first position (one direct get each on JetStream for one created after it)."""


class Subscription:
    """Finished attempts of one store (build it with ``store.subscribe_triplets`` and friends).

    Use as ``async with store.subscribe_triplets(...) as sub: async for record in sub: ...``; the
    feed starts at ``async with`` (or ``await sub.start()``, or the first iteration).

    Attributes:
        errors: Entries skipped and attempts whose data is incomplete, with log positions and ids.
        start_seq: The first log position this subscription reads (after ``start``).
        unattempted: The rollouts the last ``collect`` found ended before any attempt (cancelled in
            the queue), by id: terminal, but with no attempt to return as a ``FinishedAttempt``.
    """

    def __init__(
        self,
        log_: EventLog,
        adapter: AdapterFn,
        filters: Filters,
        *,
        durable: str | None,
        since: int | None,
        server_timeout_s: float,
    ):
        self.log = log_
        self.adapter = adapter
        self.filters = filters
        self.durable = durable
        self.since = since
        self.server_timeout_s = server_timeout_s
        self.start_seq = 0
        self._feed: Feed | None = None
        self._fold: FollowFold | None = None
        self._backlog: deque[Delivery] = deque()
        self._ready: deque[FinishedAttempt | RolloutEnded] = deque()
        self._in_hand: int | None = None
        self._folded = 0
        self._acked = 0
        self._pulling: asyncio.Task[list[Delivery]] | None = None
        self._stash: dict[str, FinishedAttempt | RolloutEnded] = {}
        self._held: dict[str, FinishedAttempt | RolloutEnded] = {}  # what the last collect returned
        self._collected: dict[str, str | None] = {}  # rollout id -> attempt id of what collect returned
        self.unattempted: dict[str, Rollout] = {}
        self._closed = False
        self._repeatable: int | None = None  # the position of the only records that can be repeats

    @property
    def errors(self) -> list[SubscriptionError]:
        return self._fold.errors if self._fold is not None else []

    async def start(self) -> Subscription:
        """Create or resume the feed (idempotent).

        Raises:
            InvalidInputError: The subscription is closed.
            ServiceUnavailableError: The log's server did not answer.
        """
        if self._feed is None:
            self._feed = await self.log.follow(self.durable, self.since, self.server_timeout_s)
            self.start_seq = self._feed.start_seq
            self._folded = self._acked = self.start_seq - 1
            self._fold = FollowFold(self.log, self.adapter, self.filters, high=self._folded)
        return self

    async def __aenter__(self) -> Subscription:
        return await self.start()

    async def __aexit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        await self.close(ack=kind is None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> FinishedAttempt:
        record = await self.next_record(None)
        if record is None:
            raise StopAsyncIteration
        return record

    async def next_record(self, timeout_s: float | None) -> FinishedAttempt | None:
        """The next finished attempt, waiting up to ``timeout_s`` seconds (``None``: until one
        comes); ``None`` on timeout or once closed. Acknowledges the record in hand first.

        Raises:
            ServiceUnavailableError: The server went away for longer than ``server_timeout_s``.
        """
        record = await self._next(timeout_s, ended=False)
        assert not isinstance(record, RolloutEnded)
        return record

    async def _next(self, timeout_s: float | None, *, ended: bool) -> FinishedAttempt | RolloutEnded | None:
        """``next_record``; with ``ended`` the fold's ``RolloutEnded`` too (``collect``), without
        them dropped: plain iteration yields each attempt once."""
        await self.start()
        if not ended:
            self._drop_ended()
        if self._in_hand is not None and not (self._ready and self._ready[0].position == self._in_hand):
            await self.ack()
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        base = cancels()
        while True:
            if not ended:
                self._drop_ended()
            if self._ready:
                break
            if self._closed:
                return None
            left = PULL_WAIT_S if deadline is None else min(PULL_WAIT_S, deadline - time.monotonic())
            if left <= 0:
                return None
            await self._step(left)
            # A cancel nats-py's wait_for swallowed (reading a rollout's history or an attempt's
            # spans): stop, as the caller asked; what was folded stays ready for the next call.
            raise_if_cancelled(base)
        record = self._ready.popleft()
        if self._repeatable is None:
            self._repeatable = record.position if record.redelivered else 0
        if record.redelivered and record.position != self._repeatable:  # pulled ahead, never yielded
            record = msgspec.structs.replace(record, redelivered=False)
        self._in_hand = record.position
        return record

    def _drop_ended(self) -> None:
        while self._ready and isinstance(self._ready[0], RolloutEnded):
            self._ready.popleft()

    async def _step(self, wait_s: float) -> None:
        """Fold the backlog until a delivery finishes an attempt, pulling more when it is empty."""
        assert self._feed is not None and self._fold is not None
        if not self._backlog:
            if self._pulling is None:
                self._pulling = asyncio.ensure_future(self._feed.next(wait_s))
            got = await asyncio.shield(self._pulling)  # cancelled: the next call awaits the same pull
            self._pulling = None
            self._backlog.extend(got)
            if not got and self._folded > self._acked:
                await self._ack_upto(self._folded)  # idle: acknowledge what produced nothing
        while self._backlog and not self._ready:
            records = await self._fold.add(self._backlog[0])
            self._folded = self._backlog.popleft().seq
            self._ready.extend(records)
        if not self._backlog and not self._ready and self._folded > self._acked + 1000:
            await self._ack_upto(self._folded)

    async def ack(self) -> None:
        """Acknowledge the records yielded so far (the one in hand and all before it).

        Raises:
            ServiceUnavailableError: The server did not confirm it.
        """
        if self._in_hand is not None:
            # up to the next record's event (exclusive): it may be the in-hand record's own event,
            # which finished several attempts, not all yielded yet
            upto = self._ready[0].position - 1 if self._ready else self._in_hand
            if upto > self._acked:
                await self._ack_upto(upto)
            self._in_hand = None

    async def _ack_upto(self, seq: int) -> None:
        assert self._feed is not None
        await self._feed.ack(seq)
        self._acked = max(self._acked, seq)

    async def collect(self, rollout_ids: Iterable[str], timeout_s: float | None) -> list[FinishedAttempt]:
        """The last attempt of each rollout in ``rollout_ids`` once the rollout is terminal, in
        ``rollout_ids`` order (never an attempt a retry superseded, ``FinishedAttempt.latest``);
        those not terminal within ``timeout_s`` seconds are left out (as ``wait_for_rollouts``
        leaves them). A rollout ended by an event that finished no latest attempt (cancelled while
        it waited for its retry) comes as its latest attempt's record again, at the ending event's
        ``position`` with the terminal ``rollout`` (plain iteration yielded that attempt when it
        finished and does not yield it again). A rollout that ended before any attempt has no
        record: it is not waited for, and is left out and listed in ``unattempted``. A rollout that
        ended before the subscription's first position (``start_seq``: it was enqueued and ran
        before one subscribed, or before ``since``, or before a durable's resume point) is taken
        from the log at once, the record a subscription that had started before it would return
        (its ``position`` below ``start_seq``), checked against the log as a kept one: one read
        of each asked rollout this subscription has nothing of (one direct get for one created
        after ``start_seq``), two and its span batches for one that ended before; one retired to
        the archive since (JetStream, ``Settings.retention_s``) is read from the archive, read
        through once for the rollouts asked together (DESIGN: the log keeps everything). Records of
        other rollouts met meanwhile are kept for a later ``collect`` (up to ``MAX_STASH``), which
        checks a kept one against the log first (one load of the rollout): a rollout sent back to
        the queue since is collected from its next run, not the kept result. When it raises, the
        results it had in hand are kept for a later ``collect``.

        A rollout the previous ``collect`` returned (or listed in ``unattempted``) is returned again
        at once, the same record (checked against the log first, as a kept one), as
        ``wait_for_rollouts`` returns a finished rollout again: asking again with the same ids after
        a partial result waits only for the others. The subscription holds what the previous
        ``collect`` returned until the next one, no longer: a rollout returned by an earlier
        ``collect`` than the previous one raises ``InvalidInputError`` at once (its record is gone
        and the feed passed it; ``store.query_spans(rollout_id, attempt_id="latest")`` reads its
        spans), unless it was sent back to the queue since, which collects its next run.

        Raises:
            InvalidInputError: A rollout an earlier ``collect`` than the previous one returned.
            ServiceUnavailableError: The server went away for longer than ``server_timeout_s``.
        """
        ids = list(dict.fromkeys(rollout_ids))
        want = set(ids)
        got: dict[str, FinishedAttempt] = {}
        self.unattempted = {}
        ended: dict[str, RolloutEnded] = {}  # taken signals of rollouts ended before any attempt
        held, self._held = self._held, {}  # the previous collect's results: held until this one
        try:
            await self.start()
            before = await self._ended_before_start([rid for rid in ids if self._unseen(rid, held)])
            for rid in ids:
                kept = self._stash.get(rid)  # newer than a held one (a run after a requeue)
                if kept is None:
                    kept = held.get(rid, before.get(rid))
                if kept is not None and await self._still_the_result(kept):  # may raise: still kept
                    self._take(got, ended, kept)
                elif kept is None and rid in self._collected:
                    await self._check_not_collected_before(rid)
                self._stash.pop(rid, None)
            deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
            while any(rid not in self.unattempted and not (rid in got and _terminal(got[rid])) for rid in ids):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                item = await self._next(left, ended=True)
                if item is None:
                    break
                if isinstance(item, RolloutEnded) and item.record is not None:
                    item = msgspec.structs.replace(item.record, redelivered=item.redelivered)
                if item.rollout.rollout_id in want:
                    self._take(got, ended, item)
                else:
                    self._keep(item)
        except BaseException:
            taken: list[FinishedAttempt | RolloutEnded] = [*got.values(), *ended.values()]
            for item in taken:  # nothing returned: kept for a later collect
                self._keep(item)
            self._held = held  # and still held
            raise
        out = [got[rid] for rid in ids if rid in got and _terminal(got[rid])]
        held_now: list[FinishedAttempt | RolloutEnded] = [*out, *ended.values()]
        self._held = {x.rollout.rollout_id: x for x in held_now}
        for rid, x in self._held.items():
            self._collected.pop(rid, None)  # the newest last: the oldest go first past MAX_STASH
            self._collected[rid] = x.attempt_id if isinstance(x, FinishedAttempt) else None
        while len(self._collected) > MAX_STASH:
            del self._collected[next(iter(self._collected))]
        return out

    def _unseen(self, rid: str, held: dict[str, FinishedAttempt | RolloutEnded]) -> bool:
        """Whether ``collect`` has nothing of ``rid`` yet: neither kept, held nor returned before."""
        return rid not in self._stash and rid not in held and rid not in self._collected

    async def _ended_before_start(self, rids: list[str]) -> dict[str, FinishedAttempt | RolloutEnded]:
        """The results of those of ``rids`` that ended before the feed's first position, by id, as
        ``collect`` takes them from the feed (a ``RolloutEnded`` with a record as that record): the
        feed never brings their end. Read from the log (``FollowFold.result_before``),
        ``READS_AT_ONCE`` rollouts at a time; ``collect`` checks a result against the log now
        before it returns it, as a kept one.

        Raises:
            ServiceUnavailableError: The log did not answer.
        """
        fold = self._fold
        assert fold is not None
        out: dict[str, FinishedAttempt | RolloutEnded] = {}
        for i in range(0, len(rids), READS_AT_ONCE):
            chunk = rids[i : i + READS_AT_ONCE]
            got = await asyncio.gather(*(fold.result_before(rid, self.start_seq) for rid in chunk))
            for rid, item in zip(chunk, got, strict=True):
                if isinstance(item, RolloutEnded) and item.record is not None:
                    item = item.record
                if item is not None:
                    out[rid] = item
        return out

    async def _check_not_collected_before(self, rid: str) -> None:
        """Raise for ``rid``, which an earlier ``collect`` returned and this subscription no longer
        holds, unless the log shows its rollout moved on since (sent back to the queue: its next
        run is collected as any rollout's).

        Raises:
            InvalidInputError: Its rollout still has the result collected then.
            ServiceUnavailableError: The log did not answer.
        """
        try:
            state, _ = await self.log.load(rid)
        except RolloutNotFoundError:  # retired to the archive: it cannot move any more
            state = None
        aid = self._collected[rid]
        if state is not None and not (
            state.rollout.status in TERMINAL_ROLLOUT_STATUSES
            and (state.latest.attempt_id if state.latest is not None else None) == aid
        ):
            del self._collected[rid]
            return
        raise InvalidInputError(
            f"rollout {rid} was returned by an earlier collect of this subscription, which holds only what "
            "the previous collect returned; its spans: store.query_spans(rollout_id, attempt_id='latest')"
        )

    def _take(
        self, got: dict[str, FinishedAttempt], ended: dict[str, RolloutEnded], item: FinishedAttempt | RolloutEnded
    ) -> None:
        rid = item.rollout.rollout_id
        if isinstance(item, RolloutEnded):  # ended before any attempt
            got.pop(rid, None)
            ended[rid] = item
            self.unattempted[rid] = item.rollout
        else:
            got[rid] = item
            ended.pop(rid, None)
            self.unattempted.pop(rid, None)

    async def _still_the_result(self, kept: FinishedAttempt | RolloutEnded) -> bool:
        """Whether a stashed result is still its rollout's, by the log now: the rollout is terminal
        and its latest attempt is the record's (none, for a rollout ended before any attempt). One
        sent back to the queue since (``update_rollout(status="queuing")``) is not: its next run's
        result is (the fold may not have read the requeue yet). A rollout retired to the archive
        can no longer move: it is.

        Raises:
            ServiceUnavailableError: The log did not answer.
        """
        try:
            state, _ = await self.log.load(kept.rollout.rollout_id)
        except RolloutNotFoundError:
            return True
        latest = state.latest
        if state.rollout.status not in TERMINAL_ROLLOUT_STATUSES:
            return False
        if isinstance(kept, RolloutEnded):
            return latest is None
        return latest is not None and latest.attempt_id == kept.attempt_id

    def _keep(self, record: FinishedAttempt | RolloutEnded) -> None:
        if len(self._stash) >= MAX_STASH:
            oldest = next(iter(self._stash))
            del self._stash[oldest]
            log.warning("subscription: %d records nobody collected; dropped the oldest (%s)", MAX_STASH, oldest)
        self._stash[record.rollout.rollout_id] = record

    async def close(self, *, ack: bool = True) -> None:
        """Stop; with ``ack`` acknowledge the record in hand first. A durable keeps its position;
        idempotent.

        Raises:
            ServiceUnavailableError: ``ack`` was asked and the server did not confirm it.
        """
        if self._closed:
            return
        self._closed = True
        pulling, self._pulling = self._pulling, None
        if pulling is not None:
            pulling.cancel()
            with contextlib.suppress(BaseException):
                await pulling
        if self._feed is None:
            return
        try:
            if ack:
                await self.ack()
        finally:
            await self._feed.close()


def _terminal(record: FinishedAttempt) -> bool:
    """Whether ``record`` is its rollout's result: the rollout ended and this is its latest attempt
    (an attempt it superseded, done at the same event, comes first and is not)."""
    return record.latest and record.rollout.status in TERMINAL_ROLLOUT_STATUSES


def subscription_filters(
    modes: str | Iterable[str] | None, resources_ids: str | Iterable[str] | None, statuses: str | Iterable[str] | None
) -> Filters:
    """The ``Filters`` of a subscription (``eventlight.replay``'s options of the same names).

    Raises:
        InvalidInputError: An unknown attempt status or rollout mode.
    """
    from eventlight.core.types import ATTEMPT_STATUSES, ROLLOUT_MODES
    from eventlight.logreplay.replay import _set

    return Filters(
        statuses=_set(statuses, ATTEMPT_STATUSES, "attempt status"),
        modes=_set(modes, ROLLOUT_MODES, "rollout mode"),
        resources_ids=_set(resources_ids),
    )
