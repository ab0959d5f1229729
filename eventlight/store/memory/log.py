"""The in-memory event log: a list of events, with the indexes the ports need.

Positions are 1-based list indexes (``events[seq - 1]``). A rollout's version is the position of
its last rollout event; ``append`` refuses a stale one with ``StaleStateError``, exactly as the
JetStream log's per-rollout expected sequence. Every appended event is handed to the subscribers
synchronously (the in-memory read model's projector), so reads see writes at once. Subscribers'
feeds (``follow``) read the list from a position and wake on each append.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from eventlight.core.commands import RolloutState
from eventlight.core.errors import RolloutNotFoundError
from eventlight.core.events import (
    AnyEvent,
    AttemptStarted,
    AttemptUpdated,
    ResourcesPut,
    RolloutCreated,
    RolloutEvent,
    RolloutUpdated,
    SpansAdded,
    encode_event,
    enters_queue,
    rollout_id_of,
)
from eventlight.core.evolve import evolve
from eventlight.core.types import ResourcesUpdate, Span
from eventlight.store.memory.signal import Signal
from eventlight.store.ports import SpanHead, StaleStateError
from eventlight.store.validate import check_span_ids_left

if TYPE_CHECKING:
    from eventlight.store.memory.follow import MemoryFeed

Subscriber = Callable[[int, AnyEvent], None]


class MemoryQueued:
    """A work-queue entry of the in-memory log (``ack``/``in_progress`` do nothing)."""

    def __init__(
        self, log: MemoryEventLog, rollout_id: str, seq: int, created: RolloutState | None, redelivered: bool = False
    ):
        self.log = log
        self.rollout_id = rollout_id
        self.seq = seq
        self.created = created
        self.redelivered = redelivered

    async def ack(self) -> None:
        """Nothing to do: the entry already left the queue."""

    async def nak(self, delay_s: float) -> None:
        """Put the entry back at the head of the queue (waiting dequeues wake up)."""
        self.log.queue.appendleft((self.rollout_id, self.seq))
        self.log.handed_back.add(self.seq)
        self.log._queued.set()

    async def in_progress(self) -> None:
        """Nothing to do: in-memory claims have no lease."""


class MemoryEventLog:
    """The whole log of one in-memory store.

    Args:
        clock: Wall-clock seconds (the time of span batches).
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.events: list[AnyEvent] = []
        """Every event in log order; position ``i + 1`` is ``events[i]``."""
        self.queue: deque[tuple[str, int]] = deque()
        self.handed_back: set[int] = set()
        """Positions of queue entries handed back (``nak``): offered again, they are redelivered."""
        self._by_rollout: dict[str, list[int]] = {}
        self._version: dict[str, int] = {}
        self._span_high: dict[tuple[str, str], int] = {}
        self._span_head: dict[tuple[str, str], SpanHead] = {}
        self._resources: dict[str, ResourcesUpdate] = {}
        self._latest_resources: str | None = None
        self._latest_resources_seq = 0
        self._subscribers: list[Subscriber] = []
        self._queued = Signal()
        self._appended = Signal()
        self.durables: dict[str, tuple[int, int]] = {}
        """Subscriptions' durable names -> (acknowledged position, delivered position)."""

    def subscribe(self, subscriber: Subscriber) -> None:
        """Call ``subscriber(position, event)`` for every event appended from now on."""
        self._subscribers.append(subscriber)

    def _add(self, event: AnyEvent) -> int:
        self.events.append(event)
        seq = len(self.events)
        rid = rollout_id_of(event)
        if rid is not None:
            self._by_rollout.setdefault(rid, []).append(seq)
            if not isinstance(event, SpansAdded):
                self._version[rid] = seq
            if enters_queue(event):
                self.queue.append((rid, seq))
                self._queued.set()
        if isinstance(event, ResourcesPut):
            self._resources[event.resources.resources_id] = event.resources
            self._latest_resources = event.resources.resources_id
            self._latest_resources_seq = seq
        for subscriber in self._subscribers:
            subscriber(seq, event)
        appended, self._appended = self._appended, Signal()
        appended.set()
        return seq

    def appended(self) -> Signal:
        """An event set at the next append."""
        return self._appended

    async def load(self, rollout_id: str) -> tuple[RolloutState, int]:
        state: RolloutState | None = None
        for seq in self._by_rollout.get(rollout_id, ()):
            state = evolve(state, self.events[seq - 1])
        if state is None:
            raise RolloutNotFoundError(rollout_id)
        return state, self._version[rollout_id]

    async def append(
        self,
        rollout_id: str,
        events: Sequence[RolloutEvent],
        expected: int,
        command_id: str,
        *,
        resources_seq: int | None = None,
    ) -> int:
        if self._version.get(rollout_id, 0) != expected:
            raise StaleStateError(f"rollout {rollout_id} is past version {expected}")
        if resources_seq is not None and resources_seq != self._latest_resources_seq:
            raise StaleStateError(f"the latest resources are past position {resources_seq}")
        seq = expected
        for event in events:
            seq = self._add(event)
        return seq

    async def publish(self, event: AnyEvent) -> int:
        return self._add(event)

    async def append_spans(
        self, rollout_id: str, attempt_id: str, spans: list[Span], *, numbered: bool, reserve: int = 0
    ) -> tuple[int | None, float, int]:
        key = (rollout_id, attempt_id)
        high = self._span_high.get(key, 0)
        if numbered:
            first = high + 1
            for j, span in enumerate(spans):
                span.sequence_id = high + 1 + j
            high += len(spans)
        else:
            high = max([high, *(s.sequence_id for s in spans)])
            first = high + 1
        high += reserve
        check_span_ids_left(rollout_id, attempt_id, high)
        at = self.clock()
        seq = self._add(SpansAdded(time=at, rollout_id=rollout_id, attempt_id=attempt_id, spans=spans, seq_high=high))
        self._span_high[key] = high
        if spans:
            self._span_head[key] = SpanHead(seq=seq, time=at, has_spans=True)
        return first, at, seq

    async def span_head(self, rollout_id: str, attempt_id: str) -> SpanHead:
        return self._span_head.get((rollout_id, attempt_id), SpanHead())

    async def resources(self, resources_id: str | None) -> ResourcesUpdate | None:
        if resources_id is None:
            resources_id = self._latest_resources
        return self._resources.get(resources_id) if resources_id is not None else None

    async def latest_resources(self) -> tuple[str | None, int]:
        return self._latest_resources, self._latest_resources_seq

    def forget_latest_resources(self) -> None:
        pass  # nothing cached: the list is the log

    async def next_queued(self, wait_s: float) -> MemoryQueued | None:
        await asyncio.sleep(0)  # a pull yields to the loop as a round trip would: a poll loop never starves it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self.queue:
            left = deadline - loop.time()
            if left <= 0:
                return None
            self._queued.clear()
            try:
                await asyncio.wait_for(self._queued.wait(), left)
            except TimeoutError:
                return None
        rid, seq = self.queue.popleft()
        event = self.events[seq - 1]
        created = RolloutState(rollout=event.rollout) if isinstance(event, RolloutCreated) else None
        redelivered = seq in self.handed_back
        self.handed_back.discard(seq)
        return MemoryQueued(self, rid, seq, created, redelivered=redelivered)

    async def read(self, from_seq: int = 0) -> AsyncIterator[tuple[int, AnyEvent]]:
        """Every event after ``from_seq``, in order (those appended meanwhile included)."""
        seq = from_seq
        while seq < len(self.events):
            seq += 1
            yield seq, self.events[seq - 1]

    async def head_seq(self) -> int:
        """The last position now (0: empty)."""
        return len(self.events)

    async def scan(self, from_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[tuple[int, str, bytes]]:
        """The log after ``from_seq`` up to ``until_seq`` (default: the head now) as the JetStream
        log's ``scan`` gives it: ``(position, subject without the prefix, encoded payload)``."""
        from eventlight.store.jetstream.layout import subject_for  # pure; the subjects both logs name

        until = len(self.events) if until_seq is None else min(until_seq, len(self.events))
        for seq in range(from_seq + 1, until + 1):
            event = self.events[seq - 1]
            yield seq, subject_for("", event)[1:], encode_event(event)

    async def follow(self, durable: str | None, since: int | None, server_timeout_s: float = 30.0) -> MemoryFeed:
        """A feed of the rollout events (``eventlight.store.ports.EventLog.follow``)."""
        from eventlight.store.memory.follow import MemoryFeed

        return MemoryFeed(self, durable, since)

    async def rollout_entries(self, rollout_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The rollout's state events before ``before_seq``, encoded as the JetStream log stores them."""
        return [
            (s, encode_event(self.events[s - 1]))
            for s in self._by_rollout.get(rollout_id, ())
            if s < before_seq and not isinstance(self.events[s - 1], SpansAdded)
        ]

    async def state_event_after(self, rollout_id: str, seq: int) -> tuple[int, RolloutEvent] | None:
        """The rollout's first state event after position ``seq``, or ``None``."""
        for s in self._by_rollout.get(rollout_id, ()):
            event = self.events[s - 1]
            if s > seq and isinstance(event, (RolloutCreated, AttemptStarted, AttemptUpdated, RolloutUpdated)):
                return s, event
        return None

    async def span_entries(self, rollout_id: str, attempt_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The attempt's span batches before ``before_seq``, encoded."""
        out: list[tuple[int, bytes]] = []
        for s in self._by_rollout.get(rollout_id, ()):
            event = self.events[s - 1]
            if s < before_seq and isinstance(event, SpansAdded) and event.attempt_id == attempt_id:
                out.append((s, encode_event(event)))
        return out

    async def close(self) -> None:
        """Nothing to release."""
