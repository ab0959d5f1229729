"""Agent-lightning 0.3.0's ``agentlightning.types``: the store's and tracer's types, under one path.

The types themselves live in ``eventlight.core.types`` (msgspec structs, not pydantic models); this
module gathers them with 0.3.0's aliases, span-name enums and protocols. The 0.1-era client/server
types (``Task``, ``TaskIfAny``, ``RolloutLegacy``, ``RolloutRawResultLegacy``) raise on use.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal, Protocol, TypedDict

import msgspec
from opentelemetry.sdk.trace import ReadableSpan

from eventlight.algorithm.base import Dataset
from eventlight.core.types import (
    LLM,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    Event,
    Link,
    NamedResources,
    OtelResource,
    PaginatedResult,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    SpanContext,
    StatusCode,
    TaskInput,
    TraceStatus,
    Triplet,
    Worker,
    WorkerStatus,
)
from eventlight.runner.hooks import Hook
from eventlight.tracer import SpanCoreFields
from eventlight.types import core, resources, tracer
from eventlight.unavailable import unavailable_class

__all__ = [
    "LLM", "Attempt", "AttemptStatus", "AttemptedRollout", "AttributeValue", "Attributes", "Dataset",
    "EnqueueRolloutRequest", "Event", "FilterField", "FilterOptions", "GenericResponse", "Hook", "Link",
    "NamedResources", "OtelResource", "PaginatedResult", "ParallelWorkerBase", "PromptTemplate", "ProxyLLM",
    "Resource", "ResourceUnion", "ResourcesUpdate", "Rollout", "RolloutConfig", "RolloutLegacy", "RolloutMode",
    "RolloutRawResult", "RolloutRawResultLegacy", "RolloutStatus", "SortOptions", "Span", "SpanAttributeNames",
    "SpanContext", "SpanCoreFields", "SpanLike", "SpanNames", "SpanRecordingContext", "StatusCode", "Task",
    "TaskIfAny", "TaskInput", "TraceState", "TraceStatus", "Triplet", "Worker", "WorkerStatus",
    "core", "resources", "tracer",
]  # fmt: skip

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
Attributes = dict[str, AttributeValue]
TraceState = dict[str, str]
ResourceUnion = Resource
SpanLike = ReadableSpan | Span
RolloutRawResult = None | float | list[ReadableSpan] | list[Span] | list[SpanCoreFields]
"""What a rollout function may return (``eventlight.agent``)."""


class SpanNames(StrEnum):
    """Names of the spans the emitters write (0.3.0's values; see ``eventlight.semconv``)."""

    REWARD = "agentlightning.reward"
    MESSAGE = "agentlightning.message"
    OBJECT = "agentlightning.object"
    EXCEPTION = "agentlightning.exception"
    VIRTUAL = "agentlightning.virtual"
    ROLLOUT_ID = "agentlightning.rollout_id"
    ATTEMPT_ID = "agentlightning.attempt_id"
    SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"


class SpanAttributeNames(StrEnum):
    MESSAGE = "message"
    OBJECT = "object"


class FilterField(TypedDict, total=False):
    """One field's conditions in a query filter (0.3.0's REST query shape)."""

    exact: Any
    within: Sequence[Any]
    contains: str


FilterOptions = dict[str, Any]
"""Field name -> ``FilterField``, plus ``"_aggregate": "and" | "or"``."""


class SortOptions(TypedDict):
    name: str
    order: Literal["asc", "desc"]


class GenericResponse(msgspec.Struct, kw_only=True):
    """A status reply (0.3.0's REST responses): ``status``, optional ``message`` and ``data``."""

    status: str = "success"
    message: str | None = None
    data: dict[str, Any] | None = None


class ParallelWorkerBase:
    """A component run in several workers (0.3.0's base of runners): ``init`` once, then per worker
    ``init_worker(worker_id)``, ``run``, ``teardown_worker``; ``teardown`` at the end."""

    worker_id: int | None = None

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Prepare shared state before the workers start."""

    def init_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        """Prepare one worker."""
        self.worker_id = worker_id

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The worker's work."""

    def teardown_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        """Release one worker's state."""

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Release shared state."""


class SpanRecordingContext(Protocol):
    """What ``Tracer.operation_context`` yields: add attributes, an exception or a status to the span."""

    def record_attributes(self, attributes: dict[str, Any]) -> None: ...

    def record_exception(self, exception: BaseException) -> None: ...

    def record_status(self, status_code: str, description: str | None = None) -> None: ...


_LEGACY = "the 0.1 client/server protocol is not supported; use the store API (Rollout, enqueue_rollout)"
Task = unavailable_class("Task", _LEGACY, __name__)
TaskIfAny = unavailable_class("TaskIfAny", _LEGACY, __name__)
RolloutLegacy = unavailable_class("RolloutLegacy", f"{_LEGACY}; a rollout function returns RolloutRawResult", __name__)
RolloutRawResultLegacy = Any
