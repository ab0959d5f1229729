"""The two ports the one store (``eventlight.store.service``) is written against.

* ``EventLog``: the source of truth. Append a command's events to one rollout with an expected
  version (the log refuses a stale one with ``StaleStateError``), load a rollout (its state folded
  from its events, span batches included, and its version), read the whole log from a position,
  plus the few things every backend keeps in the log itself: span batches numbered per attempt,
  resources snapshots, worker events and the runners' work queue.
  It also feeds subscribers (``follow``: the rollout events from a position, with a durable
  position of their own) and reads a rollout's or an attempt's raw entries before a position.
* ``ReadModel``: what the projector wrote (``eventlight.store.fold`` folds batches of events into
  it, with their checkpoint, in one transaction) and the queries over it.

A rollout's *version* is the log position of its last rollout event (spans excluded); both backends
number positions with one counter for the whole log (the JetStream stream sequence, the list index).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol

import msgspec

from eventlight.core.commands import RolloutState
from eventlight.core.events import AnyEvent, RolloutEvent
from eventlight.core.types import (
    Attempt,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    Span,
    Worker,
)


class StaleStateError(Exception):
    """An append's expected version was stale; reload and decide again."""


class SpanHead(msgspec.Struct, frozen=True):
    """An attempt's last span batch: its log position (0: none), time and whether it held spans."""

    seq: int = 0
    time: float = 0.0
    has_spans: bool = False


class Queued(Protocol):
    """A rollout offered by the work queue: ``rollout_id``, its log position ``seq``, when the
    queue entry is the rollout's creation ``created`` (the state it created, saving a load), and
    whether the queue offered this entry before (``redelivered``: handed back, or its claim's lease
    ran out; its rollout has then most likely been claimed since)."""

    rollout_id: str
    seq: int
    created: RolloutState | None
    redelivered: bool

    async def ack(self) -> None:
        """Done with it (claimed and finished, or not claimable any more)."""

    async def nak(self, delay_s: float) -> None:
        """Offer it again after ``delay_s`` seconds."""

    async def in_progress(self) -> None:
        """Still working on it (extends the claim's lease)."""


class Delivery(msgspec.Struct, frozen=True):
    """A rollout event handed to a subscriber: its log position, subject below ``el.<ns>.``
    (``r.<rid>.e``), raw payload, and whether this subscription's name had it delivered before."""

    seq: int
    subject: str
    data: bytes
    redelivered: bool = False


class Feed(Protocol):
    """The rollout events of the log, in order, from where a subscription stands (``EventLog.follow``)."""

    start_seq: int
    """The first position this feed delivers (the durable's acknowledged position + 1)."""

    async def next(self, wait_s: float) -> list[Delivery]:
        """The next deliveries, waiting up to ``wait_s`` seconds for one; ``[]`` if none came."""
        ...

    async def ack(self, seq: int) -> None:
        """Acknowledge every delivery up to position ``seq`` (the durable resumes after it); returns
        once the backend has recorded it."""
        ...

    async def close(self) -> None:
        """Stop delivering (a durable keeps its position; an ephemeral feed is deleted); idempotent."""
        ...


class EventLog(Protocol):
    """The event-log port (see the module docstring)."""

    async def load(self, rollout_id: str) -> tuple[RolloutState, int]:
        """The rollout's state and version.

        Raises:
            RolloutNotFoundError: The rollout has no events.
        """
        ...

    async def append(
        self,
        rollout_id: str,
        events: Sequence[RolloutEvent],
        expected: int,
        command_id: str,
        *,
        resources_seq: int | None = None,
    ) -> int:
        """Append a command's events to one rollout (``expected=0``: a new rollout); the new version.

        ``command_id`` makes a retried append idempotent where the backend can (JetStream's duplicate
        window). Raises ``StaleStateError`` when ``expected`` is not the rollout's version, or, with
        ``resources_seq`` (a new rollout only), when the latest resources snapshot is no longer the
        one at that position (``latest_resources``): the append names the latest resources only if
        they are still the latest when it is stored.
        """
        ...

    async def publish(self, event: AnyEvent) -> int:
        """Append an event of another aggregate (resources, a worker) unfenced; its position."""
        ...

    async def append_spans(
        self, rollout_id: str, attempt_id: str, spans: list[Span], *, numbered: bool, reserve: int = 0
    ) -> tuple[int | None, float, int]:
        """Append a span batch (``numbered``: give the spans the attempt's next ids), reserving
        ``reserve`` ids after it. Returns ``(first id given out or None if the log already held this
        batch, the batch's time, its position)``."""
        ...

    async def span_head(self, rollout_id: str, attempt_id: str) -> SpanHead:
        """The attempt's last span batch."""
        ...

    async def resources(self, resources_id: str | None) -> ResourcesUpdate | None:
        """A resources snapshot by id, or the latest one (``None``)."""
        ...

    async def latest_resources(self) -> tuple[str | None, int]:
        """``(id of the latest resources snapshot or None, the position that fences it)``, to pass as
        ``append(..., resources_seq=)``; it may come from a cache, which ``append``'s fence checks
        (and ``forget_latest_resources`` drops after a ``StaleStateError``)."""
        ...

    def forget_latest_resources(self) -> None:
        """Drop what ``latest_resources`` cached: the next call reads the log."""
        ...

    async def next_queued(self, wait_s: float) -> Queued | None:
        """The oldest rollout on the work queue, waiting up to ``wait_s`` seconds; ``None`` if none.
        It yields to the event loop at least once, and a caller cancelled during it takes nothing:
        an entry it brings after the cancel goes back to the queue."""
        ...

    def read(self, from_seq: int = 0) -> AsyncIterator[tuple[int, AnyEvent]]:
        """Every event after position ``from_seq``, in log order."""
        ...

    async def head_seq(self) -> int:
        """The log's last position now (0: empty)."""
        ...

    def scan(self, from_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[tuple[int, str, bytes]]:
        """The raw log after ``from_seq`` up to ``until_seq`` (default: the head now) as ``(position,
        subject below el.<ns>., payload)``, undecoded (``eventlight.replay`` reads it); never writes."""
        ...

    async def follow(self, durable: str | None, since: int | None, server_timeout_s: float = 30.0) -> Feed:
        """A feed of the rollout events (subjects ``r.>``). ``durable``: resume after its
        acknowledged position, or, new, start after ``since`` (default: the head now); ``None``: an
        ephemeral feed after ``since`` (default: the head now). ``server_timeout_s``: how long the
        feed retries a server that went away before ``next`` raises ``ServiceUnavailableError``.

        Raises:
            InvalidInputError: ``durable`` is not a valid consumer name.
            ServiceUnavailableError: The log's server did not answer.
        """
        ...

    async def rollout_entries(self, rollout_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The rollout's raw state events (not its spans) before position ``before_seq``, in order."""
        ...

    async def state_event_after(self, rollout_id: str, seq: int) -> tuple[int, RolloutEvent] | None:
        """The rollout's first state event (not its spans) after position ``seq`` and its position;
        ``None`` if there is none (one direct get on JetStream)."""
        ...

    async def span_entries(self, rollout_id: str, attempt_id: str, before_seq: int) -> list[tuple[int, bytes]]:
        """The attempt's raw span batches (and reservations) before position ``before_seq``, in order."""
        ...

    async def close(self) -> None:
        """Release what the log holds; idempotent."""
        ...


class ReadModel(Protocol):
    """The read-model port: the projection and its queries (arguments as ``LightningStore``'s)."""

    async def sync(self, seq: int) -> None:
        """Wait until the projection includes log position ``seq``."""
        ...

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout]: ...

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None: ...

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]: ...

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None: ...

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None) -> list[Rollout]: ...

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]: ...

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]: ...

    async def query_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        worker_id_in: Sequence[str] | None = None,
    ) -> PaginatedResult[Worker]: ...

    async def statistics(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


Order = Literal["asc", "desc"]
