"""The JSON bodies of the ``/v1/agl`` routes, as Agent-lightning 0.3.0's store server names them.

``msgspec`` structs, decoded straight from the request bytes (unknown keys are ignored, as
pydantic does by default); ``UNSET`` fields are "left out" (an update leaves them as they are),
distinct from an explicit ``null``. Their JSON schemas go into the OpenAPI description.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from eventlight.core.types import (
    AttemptStatus,
    EnqueueRolloutRequest,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    WorkerStatus,
)

T = TypeVar("T")
SortOrder = Literal["asc", "desc"]
FilterLogic = Literal["and", "or"]


class RolloutRequest(msgspec.Struct, kw_only=True):
    """``POST /rollouts``: ``start_rollout``."""

    input: Any = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    worker_id: str | None = None


class EnqueueManyRolloutsRequest(msgspec.Struct, kw_only=True):
    """``POST /queues/rollouts/enqueue``."""

    rollouts: list[EnqueueRolloutRequest]


class DequeueRequest(msgspec.Struct, kw_only=True):
    """``POST /queues/rollouts/dequeue`` (an empty body means these defaults)."""

    limit: int = 1
    worker_id: str | None = None


class StartAttemptRequest(msgspec.Struct, kw_only=True):
    """``POST /rollouts/{rollout_id}/attempts``."""

    worker_id: str | None = None


class UpdateRolloutRequest(msgspec.Struct, kw_only=True):
    """``POST /rollouts/{rollout_id}``: only the keys present change; ``status``/``config`` may not be null."""

    input: Any | UnsetType = UNSET
    mode: RolloutMode | None | UnsetType = UNSET
    resources_id: str | None | UnsetType = UNSET
    status: RolloutStatus | UnsetType = UNSET
    config: RolloutConfig | UnsetType = UNSET
    metadata: dict[str, Any] | None | UnsetType = UNSET


class UpdateAttemptRequest(msgspec.Struct, kw_only=True):
    """``POST /rollouts/{rollout_id}/attempts/{attempt_id}``: only the keys present change; none may be null."""

    status: AttemptStatus | UnsetType = UNSET
    worker_id: str | UnsetType = UNSET
    last_heartbeat_time: float | UnsetType = UNSET
    metadata: dict[str, Any] | UnsetType = UNSET


class UpdateWorkerRequest(msgspec.Struct, kw_only=True):
    """``POST /workers/{worker_id}``: a heartbeat, with stats when given (not null)."""

    heartbeat_stats: dict[str, Any] | UnsetType = UNSET


class Page(msgspec.Struct, kw_only=True):
    """Paging and sorting, shared by every search body."""

    limit: int = -1
    offset: int = 0
    sort_by: str | None = None
    sort_order: SortOrder = "asc"


class QueryRolloutsRequest(Page, kw_only=True):
    """``POST /rollouts/search``: ``query_rollouts``."""

    status_in: list[RolloutStatus] | None = None
    rollout_id_in: list[str] | None = None
    rollout_id_contains: str | None = None
    filter_logic: FilterLogic = "and"


class QueryAttemptsRequest(Page, kw_only=True):
    """``POST /rollouts/{rollout_id}/attempts/search``: ``query_attempts``."""

    sort_by: str | None = "sequence_id"


class QueryWorkersRequest(Page, kw_only=True):
    """``POST /workers/search``: ``query_workers``."""

    status_in: list[WorkerStatus] | None = None
    worker_id_contains: str | None = None
    filter_logic: FilterLogic = "and"


class QuerySpansRequest(Page, kw_only=True):
    """``POST /spans/search``: ``query_spans``."""

    rollout_id: str
    attempt_id: str | None = None
    trace_id: str | None = None
    trace_id_contains: str | None = None
    span_id: str | None = None
    span_id_contains: str | None = None
    parent_id: str | None = None
    parent_id_contains: str | None = None
    name: str | None = None
    name_contains: str | None = None
    filter_logic: FilterLogic = "and"
    sort_by: str | None = "sequence_id"


class NextSequenceIdRequest(msgspec.Struct, kw_only=True):
    """``POST /spans/next``."""

    rollout_id: str
    attempt_id: str


class NextSequenceIdResponse(msgspec.Struct, kw_only=True):
    sequence_id: int


class WaitForRolloutsRequest(msgspec.Struct, kw_only=True):
    """``POST /waits/rollouts``: ``timeout`` in seconds, ``null`` = the server's longest wait."""

    rollout_ids: list[str]
    timeout: float | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """Every error answer: a one-line ``detail``, the error's class name and whether a retry may succeed."""

    detail: str
    error_type: str
    retryable: bool = False


class Paginated(msgspec.Struct, Generic[T], kw_only=True):
    """The JSON shape of a ``PaginatedResult`` (for the OpenAPI description)."""

    items: list[T]
    limit: int
    offset: int
    total: int
