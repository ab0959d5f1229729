"""The fold: ``evolve(state, event) -> state`` for rollouts and ``evolve_worker`` for workers.

Synchronous and pure. Every reader of the log folds with these functions: the one store's command
loop (a rollout's state before it decides), the projector (both read models) and a rebuild.

Spans move an attempt too: its first span moves it ``preparing`` → ``running``, a span revives an
``unresponsive`` attempt, and every span batch stamps ``last_heartbeat_time`` (kept monotone).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from eventlight.core.commands import RolloutState
from eventlight.core.errors import AttemptNotFoundError
from eventlight.core.events import (
    AnyEvent,
    AttemptStarted,
    AttemptUpdated,
    RolloutCreated,
    RolloutUpdated,
    SpansAdded,
    WorkerHeartbeat,
    WorkerIdle,
)
from eventlight.core.types import STATUS_REASON, Attempt, Worker

_ATTEMPT_FIELDS = ("status", "end_time", "worker_id", "metadata")
_ROLLOUT_FIELDS = ("input", "mode", "resources_id", "status", "end_time", "config", "metadata")


def _replace_attempt(attempts: tuple[Attempt, ...], new: Attempt) -> tuple[Attempt, ...]:
    return tuple(new if a.attempt_id == new.attempt_id else a for a in attempts)


def spans_arrived(state: RolloutState, attempt_id: str, at: float) -> RolloutState:
    """The state after a batch of spans of ``attempt_id`` written at ``at`` (a heartbeat).

    An unknown attempt leaves the state as it is.
    """
    try:
        attempt = state.attempt(attempt_id)
    except AttemptNotFoundError:
        return state
    changes: dict[str, Any] = {"last_heartbeat_time": max(at, attempt.last_heartbeat_time or 0.0)}
    if attempt.status in ("preparing", "unresponsive"):
        changes["status"] = "running"
        changes["end_time"] = None
        if attempt.status == "unresponsive":
            changes.update(_without_reason(attempt))
    new = msgspec.structs.replace(attempt, **changes)
    rollout = state.rollout
    latest = state.latest
    if (
        "status" in changes
        and latest is not None
        and latest.attempt_id == new.attempt_id
        and rollout.status in ("preparing", "requeuing", "queuing")
    ):
        rollout = msgspec.structs.replace(rollout, status="running")
    return RolloutState(rollout=rollout, attempts=_replace_attempt(state.attempts, new))


def _evolve_attempt_updated(state: RolloutState, event: AttemptUpdated) -> RolloutState:
    rollout = state.rollout
    if event.rollout_status is not None:
        end = event.rollout_end_time if event.rollout_end_time is not None else rollout.end_time
        rollout = msgspec.structs.replace(rollout, status=event.rollout_status, end_time=end)
    try:
        old = state.attempt(event.attempt_id)
    except AttemptNotFoundError:
        return RolloutState(rollout=rollout, attempts=state.attempts)
    changes = {f: getattr(event, f) for f in _ATTEMPT_FIELDS if getattr(event, f) is not UNSET}
    if event.last_heartbeat_time is not UNSET:  # heartbeats only move forward (spans stamp them too)
        known = old.last_heartbeat_time
        hb = event.last_heartbeat_time
        changes["last_heartbeat_time"] = hb if known is None or (hb is not None and hb > known) else known
    if changes.get("status") in ("running", "succeeded") and event.metadata is UNSET:
        changes.update(_without_reason(old))  # the watchdog's "unresponsive: ..." no longer says why
    new = msgspec.structs.replace(old, **changes)
    return RolloutState(rollout=rollout, attempts=_replace_attempt(state.attempts, new))


def _without_reason(attempt: Attempt) -> dict[str, Any]:
    """``{"metadata": ...}`` without ``STATUS_REASON`` when the attempt's metadata holds one (an
    attempt that revives or succeeds after the watchdog's ``unresponsive`` kept its stale reason),
    else nothing to change. Metadata left empty becomes ``None``, as before the watchdog wrote it."""
    if not attempt.metadata or STATUS_REASON not in attempt.metadata:
        return {}
    rest = {k: v for k, v in attempt.metadata.items() if k != STATUS_REASON}
    return {"metadata": rest or None}


def _evolve_rollout_updated(state: RolloutState, event: RolloutUpdated) -> RolloutState:
    changes = {f: getattr(event, f) for f in _ROLLOUT_FIELDS if getattr(event, f) is not UNSET}
    return RolloutState(rollout=msgspec.structs.replace(state.rollout, **changes), attempts=state.attempts)


def evolve(state: RolloutState | None, event: AnyEvent) -> RolloutState | None:
    """Apply one event to a rollout's state and return the new state (the input is not changed).

    Events of other aggregates (resources, workers) and events of an unknown rollout leave the
    state as it is, so a projector can feed every event through.
    """
    if isinstance(event, RolloutCreated):
        return RolloutState(rollout=event.rollout)
    if state is None:
        return None
    if isinstance(event, AttemptStarted):
        rollout = msgspec.structs.replace(state.rollout, status=event.rollout_status)
        return RolloutState(rollout=rollout, attempts=(*state.attempts, event.attempt))
    if isinstance(event, AttemptUpdated):
        return _evolve_attempt_updated(state, event)
    if isinstance(event, RolloutUpdated):
        return _evolve_rollout_updated(state, event)
    if isinstance(event, SpansAdded):
        if not event.spans:  # a reservation of sequence ids is not a heartbeat
            return state
        return spans_arrived(state, event.attempt_id, event.time)
    return state


def _worker_finished(w: Worker, attempt: Attempt, at: float) -> Worker:
    if w.current_attempt_id not in (None, attempt.attempt_id):
        return w  # the worker already moved on to another attempt
    return msgspec.structs.replace(
        w,
        status="idle" if attempt.status in ("succeeded", "failed") else "unknown",
        last_idle_time=at,
        current_rollout_id=None,
        current_attempt_id=None,
    )


def _worker_busy(w: Worker, attempt: Attempt, at: float, *, dequeued: bool) -> Worker:
    changes: dict[str, Any] = {"last_dequeue_time": at} if dequeued else {}
    return msgspec.structs.replace(
        w,
        status="busy",
        last_busy_time=at,
        current_rollout_id=attempt.rollout_id,
        current_attempt_id=attempt.attempt_id,
        **changes,
    )


def evolve_worker(
    worker: Worker | None, event: AnyEvent, worker_id: str, attempt: Attempt | None = None
) -> Worker | None:
    """Derive worker ``worker_id``'s record from an event; ``None`` if the event does not concern it.

    Args:
        worker: The worker's record so far (``None``: not seen yet).
        event: The event.
        worker_id: The worker to derive.
        attempt: For ``AttemptUpdated``, the attempt after the event (it names the worker).
    """
    w = worker or Worker(worker_id=worker_id)
    if isinstance(event, WorkerHeartbeat) and event.worker_id == worker_id:
        stats = event.heartbeat_stats if event.heartbeat_stats is not None else w.heartbeat_stats
        return msgspec.structs.replace(w, last_heartbeat_time=event.time, heartbeat_stats=stats)
    if isinstance(event, WorkerIdle) and event.worker_id == worker_id:
        changes: dict[str, Any] = {"last_dequeue_time": event.time, "status": "idle"}
        if w.status != "idle":
            changes["last_idle_time"] = event.time
        return msgspec.structs.replace(w, **changes)
    if isinstance(event, AttemptStarted) and event.attempt.worker_id == worker_id:
        return _worker_busy(w, event.attempt, event.time, dequeued=True)
    if isinstance(event, AttemptUpdated) and attempt is not None and attempt.worker_id == worker_id:
        if attempt.status in ("succeeded", "failed", "timeout", "unresponsive"):
            return _worker_finished(w, attempt, event.time)
        return _worker_busy(w, attempt, event.time, dequeued=False)
    return None


def workers_of(event: AnyEvent, attempt: Attempt | None = None) -> list[str]:
    """The worker ids an event may change (``attempt``: as for ``evolve_worker``)."""
    if isinstance(event, (WorkerHeartbeat, WorkerIdle)):
        return [event.worker_id]
    if isinstance(event, AttemptStarted) and event.attempt.worker_id:
        return [event.attempt.worker_id]
    if isinstance(event, AttemptUpdated) and attempt is not None and attempt.worker_id:
        return [attempt.worker_id]
    return []


def updated_attempt(state: RolloutState | None, event: AnyEvent) -> Attempt | None:
    """The attempt an ``AttemptUpdated`` changed, as it is in ``state`` (the state after the event)."""
    if state is None or not isinstance(event, AttemptUpdated):
        return None
    try:
        return state.attempt(event.attempt_id)
    except AttemptNotFoundError:
        return None
