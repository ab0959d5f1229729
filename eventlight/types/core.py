"""``agentlightning.types.core``: rollouts, attempts, workers, queries (``eventlight.core.types``)."""

from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    PaginatedResult,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    TaskInput,
    Triplet,
    Worker,
    WorkerStatus,
)

__all__ = [
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "EnqueueRolloutRequest",
    "PaginatedResult",
    "Rollout",
    "RolloutConfig",
    "RolloutMode",
    "RolloutStatus",
    "TaskInput",
    "Triplet",
    "Worker",
    "WorkerStatus",
]
