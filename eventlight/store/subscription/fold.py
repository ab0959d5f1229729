"""The subscribers' fold: rollout events in, finished attempts out.

Each delivery (a rollout event) is folded with the pure ``evolve`` into its rollout's state; the
attempts it made done (``eventlight.store.finish.newly_done``) get their span batches read from the
log *before* the delivery's position and go through the adapter (``records.adapt``). A rollout first
met mid-life (a subscription that started or resumed after it was created) has its earlier events
read from the log first, so the fold's state, and what it yields, do not depend on where the
subscription started. A terminal rollout's state is dropped (read again should it move once more).
The feed carries no span batches, so an attempt done because its rollout ended (``unresponsive``,
``preparing`` or ``running`` then) is folded once more with its span batches in log order: a record
shows the attempt as the read model and a replay have it at that position (a superseded attempt
that a late span revived is ``running``, not ``unresponsive``).

An event that makes its rollout terminal without making its latest attempt done (the latest had
failed, the rollout waited for its retry, and was cancelled; or it never had an attempt) also gives a
``RolloutEnded``: internal, what ``Subscription.collect`` takes as the rollout's result (the latest
attempt's record again, at this position with the terminal rollout), never yielded to plain
iteration. ``result_before`` gives the same for a rollout that ended before the feed's first
position, from its events in the log, for ``collect`` (the feed never brings that end).
A delivery at or before the highest position folded so far is a redelivery and is
skipped: each attempt is yielded once per subscription. An entry that is not an event is recorded in ``errors``
with its position and skipped.
"""

from __future__ import annotations

import contextlib
import logging

import msgspec

from eventlight.core.commands import RolloutState
from eventlight.core.errors import InvalidInputError
from eventlight.core.events import AnyEvent, AttemptStarted, SpansAdded, decode_event, rollout_id_of
from eventlight.core.evolve import evolve, spans_arrived
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, Attempt, Rollout
from eventlight.logreplay.records import AdapterFn
from eventlight.logreplay.select import Filters
from eventlight.store.finish import FINAL_ATTEMPT_STATUSES, newly_done
from eventlight.store.ports import Delivery, EventLog
from eventlight.store.subscription.records import FinishedAttempt, SubscriptionError, adapt

log = logging.getLogger(__name__)

_DECODE_ERRORS = (InvalidInputError, msgspec.DecodeError)


class RolloutEnded(msgspec.Struct, frozen=True, kw_only=True):
    """Internal: ``rollout`` became terminal at log ``position`` by an event that made no latest
    attempt done. ``record``: its latest attempt's record again (``latest=True``, this position,
    the terminal rollout; spans before this position), ``None`` when it never had an attempt."""

    rollout: Rollout
    position: int
    record: FinishedAttempt | None
    redelivered: bool = False


class FollowFold:
    """See the module docstring.

    Args:
        log: The event log (earlier events of a rollout, span batches).
        adapter: An attempt's spans -> its data.
        filters: Which finished attempts to yield (``statuses``, ``modes``, ``resources_ids``).
        high: Positions up to this one were folded before (a resumed subscription's start - 1).
    """

    def __init__(self, log: EventLog, adapter: AdapterFn, filters: Filters, high: int = 0):
        self.log = log
        self.adapter = adapter
        self.filters = filters
        self.high = high
        self.states: dict[str, RolloutState] = {}
        self.started: dict[tuple[str, str], int] = {}
        self.errors: list[SubscriptionError] = []

    async def add(self, d: Delivery) -> list[FinishedAttempt | RolloutEnded]:
        """Fold one delivery; the attempts it finished that pass the filters, in attempt order, then
        a ``RolloutEnded`` when it ended the rollout and finished no latest attempt.

        Nothing changes until every read it needs is done: a call cancelled midway can be repeated.

        Raises:
            ServiceUnavailableError: The log did not answer.
        """
        if d.seq <= self.high:
            return []
        event = self._decode(d.seq, d.data, d.subject.split(".")[1] if d.subject.count(".") == 2 else None)
        rid = rollout_id_of(event) if event is not None else None
        if event is None or rid is None:
            self.high = d.seq
            return []
        before = self.states.get(rid)
        started: dict[tuple[str, str], int] = {}
        if before is None:
            before = await self._history(rid, d.seq, started)
        after = evolve(before, event)
        if after is None:  # an event of a rollout whose creation the log does not hold
            self._error(d.seq, rid, None, "an event of a rollout the log has no creation of; skipped")
            self.high = d.seq
            return []
        _note_started(started, rid, event, d.seq)
        out, errors = await self._records(before, after, event, d.seq, d.redelivered, started)
        self._commit(rid, after, started, d.seq)
        self.errors += errors
        return out

    async def result_before(self, rid: str, seq: int) -> FinishedAttempt | RolloutEnded | None:
        """The result of rollout ``rid`` as the log had it before position ``seq``, when it was
        terminal there: what ``add`` gave at the event that last made it terminal (its latest
        attempt's record, or a ``RolloutEnded``), as a fold that had started before that event
        would have it. ``None`` when the rollout was not terminal before ``seq`` (or the log has no
        such rollout), or when its latest attempt does not pass the filters.

        For ``Subscription.collect``: a rollout that ended before the feed's first position
        (``seq``: ``Feed.start_seq``), whose end the feed never brings. One read of the rollout's
        events (and of its latest attempt's span batches when it was terminal); the fold's own
        position and states do not change (its ``errors`` take what the record's data lacks).

        Raises:
            ServiceUnavailableError: The log did not answer.
        """
        state: RolloutState | None = None
        started: dict[tuple[str, str], int] = {}
        end: tuple[RolloutState | None, AnyEvent, int] | None = None
        for pos, data in await self.log.rollout_entries(rid, seq):
            event = self._decode(pos, data, rid)
            after = evolve(state, event) if event is not None else state
            if event is None or after is None:
                continue
            _note_started(started, rid, event, pos)
            if _terminal(after) and not (state is not None and _terminal(state)):
                end = (state, event, pos)
            state = after
        if end is None or state is None or not _terminal(state):
            return None
        before, event, pos = end
        after = evolve(before, event)
        assert after is not None
        out, errors = await self._records(before, after, event, pos, False, started)
        self.errors += errors
        return next((x for x in out if isinstance(x, RolloutEnded) or x.latest), None)

    async def _records(
        self,
        before: RolloutState | None,
        after: RolloutState,
        event: AnyEvent,
        seq: int,
        redelivered: bool,
        started: dict[tuple[str, str], int],
    ) -> tuple[list[FinishedAttempt | RolloutEnded], list[SubscriptionError]]:
        """What the event at ``seq`` that moved ``before`` to ``after`` gives (``add``), with the
        errors of the records' data; reads span batches, changes nothing."""
        rid = after.rollout.rollout_id
        out: list[FinishedAttempt | RolloutEnded] = []
        errors: list[SubscriptionError] = []
        done = [a for a in newly_done(before, after) if self._selected(after, a.status)]
        read = {a.attempt_id: await self.log.span_entries(rid, a.attempt_id, seq) for a in done}
        if any(a.status not in FINAL_ATTEMPT_STATUSES for a in done):
            done = await self._with_spans(rid, seq, event, done, read)
        for attempt in done:
            batches = read[attempt.attempt_id]
            key = (rid, attempt.attempt_id)
            pos = started.get(key, self.started.get(key))
            latest = after.latest is not None and after.latest.attempt_id == attempt.attempt_id
            record, errs = adapt(after.rollout, attempt, latest, batches, self.adapter, seq, pos, redelivered)
            out.append(record)
            errors += errs
        ended = await self._ended(before, after, done, seq, redelivered, started)
        if ended is not None:
            out.append(ended)
        return out, errors

    async def _ended(
        self,
        before: RolloutState | None,
        after: RolloutState,
        done: list[Attempt],
        seq: int,
        redelivered: bool,
        started: dict[tuple[str, str], int],
    ) -> RolloutEnded | None:
        """The ``RolloutEnded`` of an event that ended its rollout without making its latest attempt
        done (it was already, or there is none), when the rollout passes the filters; else ``None``."""
        if after.rollout.status not in TERMINAL_ROLLOUT_STATUSES:
            return None
        if before is not None and before.rollout.status in TERMINAL_ROLLOUT_STATUSES:
            return None
        latest = after.latest
        if latest is not None and any(a.attempt_id == latest.attempt_id for a in done):
            return None
        if not self._selected(after, latest.status if latest is not None else None):
            return None
        record = None
        if latest is not None:
            rid, aid = after.rollout.rollout_id, latest.attempt_id
            batches = await self.log.span_entries(rid, aid, seq)
            pos = started.get((rid, aid), self.started.get((rid, aid)))
            # its data's errors went to ``errors`` with the attempt's own record
            record, _ = adapt(after.rollout, latest, True, batches, self.adapter, seq, pos, redelivered)
        return RolloutEnded(rollout=after.rollout, position=seq, record=record, redelivered=redelivered)

    async def _with_spans(
        self, rid: str, seq: int, event: AnyEvent, done: list[Attempt], read: dict[str, list[tuple[int, bytes]]]
    ) -> list[Attempt]:
        """``done`` as the read model has them at ``seq``: the rollout's events and each attempt's
        span batches folded in log order (a span revives an ``unresponsive`` attempt and moves a
        ``preparing`` one to ``running``; the feed carries no spans). Only for attempts done with a
        status a span can still change (their rollout ended first): one read of the rollout's events."""
        items: list[tuple[int, AnyEvent | None, str, float]] = []
        for pos, data in await self.log.rollout_entries(rid, seq):
            with contextlib.suppress(*_DECODE_ERRORS):  # reported when the fold first met it
                items.append((pos, decode_event(data), "", 0.0))
        items.append((seq, event, "", 0.0))
        for aid, batches in read.items():
            for pos, data in batches:
                with contextlib.suppress(*_DECODE_ERRORS):  # reported by ``adapt``
                    batch = decode_event(data)
                    if isinstance(batch, SpansAdded) and batch.spans:
                        items.append((pos, None, aid, batch.time))
        state: RolloutState | None = None
        for _, ev, aid, at in sorted(items, key=lambda item: item[0]):
            if ev is not None:
                state = evolve(state, ev)
            elif state is not None:
                state = spans_arrived(state, aid, at)
        if state is None:
            return done
        return [state.attempt(a.attempt_id) for a in done]

    def _selected(self, state: RolloutState, status: str | None) -> bool:
        """Whether the filters take an attempt of ``status`` of this rollout (``None``: no attempt)."""
        f = self.filters
        by_status = f.statuses is None or status is None or status in f.statuses
        return by_status and f.rollout_matches(state.rollout)

    def _commit(self, rid: str, after: RolloutState, started: dict[tuple[str, str], int], seq: int) -> None:
        self.high = seq
        self.started.update(started)
        if after.rollout.status in TERMINAL_ROLLOUT_STATUSES:
            self.states.pop(rid, None)
            for a in after.attempts:
                self.started.pop((rid, a.attempt_id), None)
        else:
            self.states[rid] = after

    async def _history(self, rid: str, seq: int, started: dict[tuple[str, str], int]) -> RolloutState | None:
        """The rollout's state from its events before ``seq`` (where its attempts started too)."""
        state: RolloutState | None = None
        for pos, data in await self.log.rollout_entries(rid, seq):
            event = self._decode(pos, data, rid)
            if event is not None:
                state = evolve(state, event)
                _note_started(started, rid, event, pos)
        return state

    def _decode(self, seq: int, data: bytes, rid: str | None) -> AnyEvent | None:
        try:
            return decode_event(data)
        except _DECODE_ERRORS as e:
            self._error(seq, rid, None, f"not an event this version reads, skipped: {e}")
            return None

    def _error(self, seq: int, rid: str | None, aid: str | None, why: str) -> None:
        if any(e.position == seq for e in self.errors[-8:]):
            return  # the same entry met again (a rollout's history read twice)
        self.errors.append(SubscriptionError(seq, rid, aid, why))
        log.warning("subscription: log position %d (rollout %s): %s", seq, rid, why)


def _terminal(state: RolloutState) -> bool:
    return state.rollout.status in TERMINAL_ROLLOUT_STATUSES


def _note_started(started: dict[tuple[str, str], int], rid: str, event: AnyEvent, seq: int) -> None:
    if isinstance(event, AttemptStarted):
        started[(rid, event.attempt.attempt_id)] = seq
