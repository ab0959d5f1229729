"""Commands (what a caller asks of one rollout), the ``UNSET`` sentinel and a rollout's state.

Pure data: no I/O. ``eventlight.core.decider.decide`` turns a command into events and
``eventlight.core.evolve.evolve`` folds events into a ``RolloutState``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from eventlight.core.errors import AttemptNotFoundError
from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Rollout,
    RolloutConfig,
    RolloutStatus,
)

Unset: TypeAlias = UnsetType
"""The type of ``UNSET``: an optional update argument left out ("leave as is", not ``None``)."""

__all__ = [
    "UNSET",
    "AbandonAttempt",
    "CheckHealth",
    "Command",
    "CreateRollout",
    "RolloutState",
    "StartAttempt",
    "Unset",
    "UpdateAttempt",
    "UpdateRollout",
]


class RolloutState(msgspec.Struct, frozen=True):
    """Everything the decider knows of one rollout: the rollout and all its attempts in order."""

    rollout: Rollout
    attempts: tuple[Attempt, ...] = ()

    @property
    def latest(self) -> Attempt | None:
        """The attempt with the highest ``sequence_id``, or ``None``."""
        return self.attempts[-1] if self.attempts else None

    def attempt(self, attempt_id: str) -> Attempt:
        """Resolve an attempt id (``"latest"`` allowed).

        Raises:
            AttemptNotFoundError: No such attempt.
        """
        if not self.attempts:
            raise AttemptNotFoundError(self.rollout.rollout_id, attempt_id, "the rollout has no attempts")
        if attempt_id == "latest":
            return self.attempts[-1]
        for a in self.attempts:
            if a.attempt_id == attempt_id:
                return a
        raise AttemptNotFoundError(self.rollout.rollout_id, attempt_id)

    def attempted(self) -> Rollout:
        """The rollout with its latest attempt attached, or the plain rollout without attempts."""
        if not self.attempts:
            return self.rollout
        return AttemptedRollout(**msgspec.structs.asdict(self.rollout), attempt=self.attempts[-1])

    def attempted_rollout(self) -> AttemptedRollout:
        """The rollout with its latest attempt (the state must have one)."""
        found = self.attempted()
        assert isinstance(found, AttemptedRollout)
        return found


class CreateRollout(msgspec.Struct, frozen=True, kw_only=True):
    """``enqueue_rollout`` (``queued=True``) or ``start_rollout`` (``queued=False`` + ``attempt_id``)."""

    rollout_id: str
    input: Any
    mode: str | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    queued: bool = True
    attempt_id: str | None = None
    worker_id: str | None = None


class StartAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """A new attempt: a runner's claim of a queued rollout (``claim=True``) or ``start_attempt``."""

    attempt_id: str
    worker_id: str | None = None
    claim: bool = False


class UpdateAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """``update_attempt``: change the named fields of one attempt (``attempt_id`` resolved)."""

    attempt_id: str
    status: AttemptStatus | Unset = UNSET
    worker_id: str | None | Unset = UNSET
    last_heartbeat_time: float | None | Unset = UNSET
    metadata: dict[str, Any] | None | Unset = UNSET


class UpdateRollout(msgspec.Struct, frozen=True, kw_only=True):
    """``update_rollout``: change the named fields of a rollout."""

    input: Any | Unset = UNSET
    mode: str | None | Unset = UNSET
    resources_id: str | None | Unset = UNSET
    status: RolloutStatus | Unset = UNSET
    config: RolloutConfig | Unset = UNSET
    metadata: dict[str, Any] | None | Unset = UNSET


class CheckHealth(msgspec.Struct, frozen=True, kw_only=True):
    """The watchdog's command: mark live attempts ``timeout``/``unresponsive`` when overdue (every
    one, whatever its rollout's status; only the latest of a rollout in flight moves the rollout)."""


class AbandonAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt whose runner is gone (its process died) and cannot record it: ``failed`` with
    ``reason`` as its ``STATUS_REASON``, unless it already finished (``RunnerPool``'s command)."""

    attempt_id: str
    reason: str


Command = CreateRollout | StartAttempt | UpdateAttempt | UpdateRollout | CheckHealth | AbandonAttempt
