"""``LightningStore``: the store API algorithms and runners share (Agent-lightning 0.3 names).

Every method is a coroutine and appears atomic to concurrent callers. An unknown id raises a
``NotFoundError`` (a ``ValueError``), an invalid transition ``InvalidTransitionError``; see
``eventlight.core.errors``. Two backends implement it with the same decider:
``InMemoryLightningStore`` and ``JetStreamLightningStore``.

The choices where Agent-lightning 0.3.0's code and its docs differ, item by item against
``spec/seed_store_types.md`` §7, and other behaviours to know: ``eventlight.store.differences``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

from eventlight.core.commands import UNSET
from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Worker,
)
from eventlight.store.validate import check_one_attempt

__all__ = ["UNSET", "LightningStore", "LightningStoreCapabilities", "LightningStoreStatistics"]


class LightningStoreCapabilities(TypedDict, total=False):
    thread_safe: bool
    async_safe: bool
    zero_copy: bool
    otlp_traces: bool


class LightningStoreStatistics(TypedDict, total=False):
    """What ``statistics()`` returns (Agent-lightning 0.3.0's keys; absent keys are unknown)."""

    name: str
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    total_workers: int
    uptime: float
    """Seconds since the store object was made."""


class LightningStore(ABC):
    """The control plane between algorithms and runners (``reference_store.md``)."""

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        """What this store supports; absent keys mean ``False``."""
        return {}

    async def statistics(self) -> dict[str, Any]:
        """Counts of rollouts, attempts, spans, resources and workers, plus ``name``."""
        return {"name": type(self).__name__}

    def otlp_traces_endpoint(self) -> str:
        """The OTLP/HTTP traces URL of a store whose ``capabilities["otlp_traces"]`` is ``True``.

        Raises:
            NotImplementedError: This store does not serve OTLP (the stores themselves do not: the
                tracer publishes span batches to the stream; ``LightningStoreServer`` and
                ``LightningStoreClient`` do, at ``/v1/traces``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not serve OTLP traces (capabilities['otlp_traces'])")

    @property
    def closing(self) -> bool:
        """Whether ``close`` has begun (or is done): the store refuses calls from then on. ``False``
        for a store that does not say (``LightningStore``'s default)."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; idempotent."""

    async def __aenter__(self) -> LightningStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- rollouts and the queue --------------------------------------------------------------

    @abstractmethod
    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        """Create a rollout in ``queuing`` at the tail of the queue.

        Raises:
            ResourcesNotFoundError: ``resources_id`` is given and unknown.
        """

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]:
        """``enqueue_rollout`` for each request, in order."""
        return [await self.enqueue_rollout(r.input, r.mode, r.resources_id, r.config, r.metadata) for r in rollouts]

    @abstractmethod
    async def start_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        """Create a rollout and its first attempt at once, bypassing the queue (both ``preparing``)."""

    @abstractmethod
    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        """Claim the oldest queued rollout without blocking; ``None`` when the queue is empty.

        The claim creates attempt ``k+1`` in ``preparing`` and moves the rollout to ``preparing``.
        """

    async def dequeue_many_rollouts(self, *, limit: int = 1, worker_id: str | None = None) -> list[AttemptedRollout]:
        """Claim up to ``limit`` rollouts; fewer (or none) when the queue is shorter."""
        out: list[AttemptedRollout] = []
        for _ in range(max(0, limit)):
            r = await self.dequeue_rollout(worker_id=worker_id)
            if r is None:
                break
            out.append(r)
        return out

    @abstractmethod
    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        """Start a new attempt of an existing rollout outside the queue.

        Raises:
            RolloutNotFoundError: Unknown ``rollout_id``.
        """

    @abstractmethod
    async def update_rollout(
        self,
        rollout_id: str,
        input: Any = UNSET,
        mode: Any = UNSET,
        resources_id: Any = UNSET,
        status: Any = UNSET,
        config: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Rollout:
        """Change fields of a rollout; ``status="cancelled"`` cancels it.

        Raises:
            RolloutNotFoundError: Unknown ``rollout_id``.
            InvalidTransitionError: A finished rollout asked for a status other than a requeue.
        """

    @abstractmethod
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: Any = UNSET,
        worker_id: Any = UNSET,
        last_heartbeat_time: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Attempt:
        """Change an attempt (``attempt_id="latest"`` allowed); the latest attempt moves its rollout.

        Returns the attempt as this update left it. After a final status (``succeeded``, ``failed``,
        ``timeout``) its ``last_heartbeat_time`` may lack span batches that other processes wrote
        since this store last saw the rollout (deciding a final status does not need them, so they
        are not read); ``get_attempt``/``query_attempts`` include them.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
            InvalidTransitionError: The attempt already finished.
        """

    # -- reads -------------------------------------------------------------------------------

    @abstractmethod
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
    ) -> PaginatedResult[Rollout]:
        """Rollouts matching the filters (each with its latest attempt when it has one).

        ``status`` and ``rollout_ids`` are deprecated aliases of ``status_in`` and ``rollout_id_in``
        (``DeprecationWarning``; the new parameter wins when both are given).
        """

    @abstractmethod
    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        """The rollout (with its latest attempt when it has one), or ``None``."""

    @abstractmethod
    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        """All attempts of a rollout, oldest first by default.

        Raises:
            RolloutNotFoundError: Unknown ``rollout_id``.
        """

    @abstractmethod
    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        """The attempt with the highest ``sequence_id``; ``None`` if there is none.

        Raises:
            RolloutNotFoundError: Unknown ``rollout_id``.
        """

    @abstractmethod
    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Wait until the rollouts are finished (``succeeded``, ``failed``, ``cancelled``).

        Args:
            rollout_ids: Rollouts to wait for.
            timeout: Seconds to wait; ``None`` waits forever, ``0`` only checks.

        Returns:
            The rollouts that finished, in ``rollout_ids`` order (a subset on timeout).

        Raises:
            RolloutNotFoundError: An id is unknown.
        """

    # -- spans -------------------------------------------------------------------------------

    @abstractmethod
    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Record spans (each carrying its rollout, attempt and sequence ids); they are heartbeats.

        Returns:
            The spans recorded (duplicates by ``(rollout_id, attempt_id, span_id)`` are dropped).

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: A span names an unknown rollout or attempt.
            InvalidInputError: A span lacks its ids.
        """

    async def add_span(self, span: Span) -> Span | None:
        """Record one span; ``None`` if it was a duplicate."""
        added = await self.add_many_spans([span])
        return added[0] if added else None

    async def add_otel_span(
        self, rollout_id: str, attempt_id: str, readable_span: Any, sequence_id: int | None = None
    ) -> Span | None:
        """Convert an OpenTelemetry ``ReadableSpan`` and record it (``Span.from_opentelemetry``)."""
        from eventlight.otel import span_from_readable

        if sequence_id is None:
            sequence_id = await self.get_next_span_sequence_id(rollout_id, attempt_id)
        return await self.add_span(span_from_readable(readable_span, rollout_id, attempt_id, sequence_id))

    async def add_spans_numbered(self, rollout_id: str, attempt_id: str, spans: Sequence[Span]) -> list[Span]:
        """Give ``spans`` (all of one attempt) its next sequence ids, in order, and record them.

        An eventlight extension used by the tracer: the ``sequence_id`` fields are overwritten in
        place. Backends may do it in one step (JetStream: one append); this default allocates with
        ``get_many_span_sequence_ids`` and records with ``add_many_spans``.

        Returns:
            The spans recorded (duplicates left out, as ``add_many_spans``).

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
            InvalidInputError: A span belongs to another attempt or lacks its ids.
        """
        check_one_attempt(rollout_id, attempt_id, spans)
        ids = await self.get_many_span_sequence_ids([(rollout_id, attempt_id)] * len(spans))
        for span, sequence_id in zip(spans, ids, strict=True):
            span.sequence_id = sequence_id
        return await self.add_many_spans(spans)

    @abstractmethod
    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        """Allocate one sequence id per ``(rollout_id, attempt_id)``; increasing within an attempt.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
        """

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        """Allocate the next span sequence id of an attempt (1, 2, ... without gaps)."""
        return (await self.get_many_span_sequence_ids([(rollout_id, attempt_id)]))[0]

    @abstractmethod
    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
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
    ) -> PaginatedResult[Span]:
        """Spans of a rollout (``attempt_id="latest"`` for its latest attempt), by ``sequence_id``.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
        """

    # -- resources ---------------------------------------------------------------------------

    @abstractmethod
    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        """Store a new snapshot (version 1) under a fresh id; it becomes the latest."""

    @abstractmethod
    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        """Create or replace the snapshot ``resources_id``: ``version + 1`` of an existing id, version 1 of
        a new one (Agent-lightning 0.3.0's behaviour); it becomes the latest.

        Raises:
            InvalidInputError: ``resources_id`` is not a valid id, or ``resources`` are not resources.
        """

    @abstractmethod
    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        """The snapshot, or ``None``."""

    @abstractmethod
    async def get_latest_resources(self) -> ResourcesUpdate | None:
        """The most recently added or updated snapshot, or ``None``."""

    @abstractmethod
    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        """Snapshots in insertion order unless ``sort_by`` is given."""

    # -- workers -----------------------------------------------------------------------------

    @abstractmethod
    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        """Record a heartbeat (and optional stats); creates the worker as ``unknown`` if new."""

    @abstractmethod
    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        """The worker, or ``None``."""

    @abstractmethod
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
    ) -> PaginatedResult[Worker]:
        """Workers matching the filters."""
