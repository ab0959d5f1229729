"""The pure decider: every status transition of rollouts, attempts and workers.

``decide(state, command, now) -> list[event]`` and ``evolve(state, event) -> state`` are synchronous,
do no I/O and take the clock as an argument (``evolve`` lives in ``eventlight.core.evolve``). The
one store service, the projector and the watchdog call them on every backend, so they cannot disagree.

Rules (``deep-dive_store.md``; choices where Agent-lightning 0.3.0's code and docs differ are marked):

Attempt
    * Created ``preparing`` by a claim (dequeue), ``start_rollout`` or ``start_attempt``; its
      ``sequence_id`` is the number of attempts so far + 1.
    * ``preparing`` → ``running`` on its first span; ``unresponsive`` → ``running`` when a span arrives
      (revival). ``timeout``, ``failed`` and ``succeeded`` are never revived.
    * ``preparing``/``running``/``unresponsive`` → ``succeeded``/``failed``/``timeout``/``unresponsive``
      by ``update_attempt`` or the watchdog. A terminal attempt (``succeeded``, ``failed``, ``timeout``)
      refuses a status change with ``InvalidTransitionError`` (0.3.0 accepts anything; the docs and
      the peer's failure C03 argue for fencing). Repeating the current status is a no-op.
    * ``end_time`` is set on every terminal status, ``timeout`` and ``unresponsive`` included (docs).
    * The watchdog's ``timeout``/``unresponsive`` writes its reason into the attempt's metadata
      (``STATUS_REASON``); a runner writes its own there when it records ``failed``.
    * The watchdog checks every attempt still ``preparing``/``running``, whatever its rollout's
      status: the latest one of a rollout in flight (0.3.0, which checks only these), and also one
      a late span revived after its rollout finished or after its retry was claimed (superseded),
      or one still running under a rollout sent back to the queue, whose runner then vanished.
      0.3.0 never checks those, so they stay ``running`` for ever; here they go
      ``unresponsive``/``timeout`` by the rollout's ``RolloutConfig`` and move nothing else: a
      superseded attempt never moves its rollout (C01), a finished rollout is sticky and one in the
      queue waits for its next run (``_propagate``).
    * ``AbandonAttempt`` (a runner process died; its pool records it) → ``failed`` with the reason
      in its metadata, from ``preparing``/``running``/``unresponsive``; a finished attempt is left
      as it is (no events).

Rollout (an aggregated view of its latest attempt)
    * Only the latest attempt (highest ``sequence_id``) moves the rollout (C01).
    * latest attempt ``preparing``/``running``/``succeeded`` → same rollout status.
    * ``failed``/``timeout``/``unresponsive`` → ``requeuing`` if the status is in ``retry_condition``
      and ``sequence_id < max_attempts``, else ``failed``.
    * ``cancelled`` only by ``update_rollout``. The cancel also ends every attempt not yet finished
      (``preparing``/``running``/``unresponsive``): ``failed`` with ``CANCELLED_REASON`` as its
      reason, in the same append (just before the cancel; the latest attempt's end carries the
      rollout's ``cancelled``, so a cancel cut short half-way leaves no rollout in flight whose
      latest attempt ended). So a rollout cancelled and then requeued (``update_rollout(
      status="queuing")``) is run by a fresh attempt: the old runner's next heartbeat or span can no
      longer take it back (a ``failed`` attempt is never revived), and that runner, asking
      ``rollout_cancelled`` about its attempt, stops its agent. 0.3.0 marks no attempt: its runner's
      next heartbeat takes the requeued rollout back, as if it had never been cancelled.
    * A rollout in the queue (``queuing``/``requeuing``) is not failed by its latest attempt: one sent
      back by ``update_rollout(status="queuing")`` while its attempt ran waits for its next run, as
      does one ``requeuing`` whose ``unresponsive`` attempt reports ``failed`` late. A late
      ``running`` or ``succeeded`` still takes it (0.3.0: the attempt revived), unless a cancel
      before the requeue ended that attempt (see ``cancelled`` above).
    * A terminal rollout (``succeeded``, ``failed``, ``cancelled``) stays as it is whatever its
      attempts do afterwards: a late update of its latest attempt is recorded on the attempt, and
      the rollout keeps its status and ``end_time``. So a rollout ``failed`` because its latest
      attempt went ``unresponsive`` with no retry left stays ``failed`` when that runner reports
      ``succeeded`` (or ``running``) later; what ``wait_for_rollouts`` and the subscriptions reported
      stays its result. 0.3.0 lets the latest attempt overwrite any rollout status (its docs call
      these statuses terminal, and its ``InMemoryLightningStore`` comment assumes they stay).
    * A terminal rollout may only be sent back to ``queuing``/``requeuing`` by ``update_rollout``
      (or to ``preparing`` by ``start_attempt``, an explicit retry).
    * ``end_time`` is set when the rollout becomes terminal.

Worker (derived, never set directly)
    * a claim → ``busy``; attempt ``succeeded``/``failed`` → ``idle``; ``timeout``/``unresponsive`` →
      ``unknown``; an empty poll → ``idle``; heartbeats only stamp ``last_heartbeat_time``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventlight.core.commands import (
    UNSET,
    AbandonAttempt,
    CheckHealth,
    Command,
    CreateRollout,
    RolloutState,
    StartAttempt,
    UpdateAttempt,
    UpdateRollout,
)
from eventlight.core.errors import InvalidInputError, InvalidTransitionError
from eventlight.core.events import AttemptStarted, AttemptUpdated, RolloutCreated, RolloutEvent, RolloutUpdated
from eventlight.core.evolve import evolve
from eventlight.core.types import (
    ATTEMPT_STATUSES,
    CANCELLED_REASON,
    QUEUING_STATUSES,
    ROLLOUT_STATUSES,
    STATUS_REASON,
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    AttemptStatus,
    Rollout,
    RolloutConfig,
    RolloutStatus,
)

FINAL_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout"})
LIVE_ATTEMPT_STATUSES = frozenset({"preparing", "running"})
"""Attempt statuses the watchdog checks (its runner should be sending spans or heartbeats)."""
ENDING_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout", "unresponsive"})


# ---------------------------------------------------------------------------------------------
# Pure rules


def rollout_status_from_attempt(attempt: Attempt, config: RolloutConfig) -> RolloutStatus:
    """The rollout status implied by its latest attempt (Agent-lightning ``rollout_status_from_attempt``)."""
    if attempt.status in ("preparing", "running", "succeeded"):
        return attempt.status
    if attempt.status in ("failed", "timeout", "unresponsive"):
        retry = attempt.status in config.retry_condition and attempt.sequence_id < config.max_attempts
        return "requeuing" if retry else "failed"
    raise InvalidInputError(f"unknown attempt status {attempt.status!r}")


def is_claimable(state: RolloutState) -> bool:
    """Whether a queued message for this rollout may still be claimed by a runner."""
    return state.rollout.status in QUEUING_STATUSES


def _check_attempt_transition(attempt: Attempt, status: AttemptStatus) -> None:
    if status not in ATTEMPT_STATUSES:
        raise InvalidInputError(f"unknown attempt status {status!r}; expected one of {sorted(ATTEMPT_STATUSES)}")
    if attempt.status == status:
        return
    if attempt.status in FINAL_ATTEMPT_STATUSES:
        raise InvalidTransitionError(
            f"attempt {attempt.attempt_id} of rollout {attempt.rollout_id}",
            attempt.status,
            status,
            "the attempt already finished",
        )
    if status == "preparing":
        raise InvalidTransitionError(
            f"attempt {attempt.attempt_id} of rollout {attempt.rollout_id}",
            attempt.status,
            status,
            "an attempt never goes back to preparing",
        )


def _propagate(state: RolloutState, attempt: Attempt, now: float) -> tuple[RolloutStatus | None, float | None]:
    """Rollout status (and end time) after ``attempt`` changed, or ``(None, None)`` if unchanged."""
    rollout = state.rollout
    latest = state.latest
    if latest is None or latest.attempt_id != attempt.attempt_id or rollout.status in TERMINAL_ROLLOUT_STATUSES:
        return None, None  # only the latest attempt moves its rollout, and never a finished one
    new = rollout_status_from_attempt(attempt, rollout.config)
    if new == rollout.status or (rollout.status in QUEUING_STATUSES and new in ("requeuing", "failed")):
        return None, None  # a rollout back in the queue waits for its next run: its last attempt's failure ends nothing
    return new, (now if new in TERMINAL_ROLLOUT_STATUSES else None)


def _decide_create(cmd: CreateRollout, now: float) -> list[RolloutEvent]:
    rollout = Rollout(
        rollout_id=cmd.rollout_id,
        input=cmd.input,
        start_time=now,
        mode=cmd.mode,
        resources_id=cmd.resources_id,
        status="queuing" if cmd.queued else "preparing",
        config=msgspec.structs.replace(cmd.config) if cmd.config is not None else RolloutConfig(),
        metadata=dict(cmd.metadata) if cmd.metadata is not None else {},
    )
    events: list[RolloutEvent] = [RolloutCreated(time=now, rollout=rollout)]
    if not cmd.queued:
        if cmd.attempt_id is None:
            raise InvalidInputError("start_rollout needs an attempt id")
        attempt = Attempt(
            rollout_id=cmd.rollout_id,
            attempt_id=cmd.attempt_id,
            sequence_id=1,
            start_time=now,
            worker_id=cmd.worker_id,
        )
        events.append(AttemptStarted(time=now, attempt=attempt))
    return events


def _decide_start(state: RolloutState, cmd: StartAttempt, now: float) -> list[RolloutEvent]:
    if cmd.claim and not is_claimable(state):
        raise InvalidTransitionError(
            f"rollout {state.rollout.rollout_id}",
            state.rollout.status,
            "preparing",
            "it is not queued",
        )
    attempt = Attempt(
        rollout_id=state.rollout.rollout_id,
        attempt_id=cmd.attempt_id,
        sequence_id=len(state.attempts) + 1,
        start_time=now,
        worker_id=cmd.worker_id,
    )
    return [AttemptStarted(time=now, attempt=attempt)]


def _decide_update_attempt(state: RolloutState, cmd: UpdateAttempt, now: float) -> list[RolloutEvent]:
    old = state.attempt(cmd.attempt_id)
    changes: dict[str, Any] = {}
    if cmd.status is not UNSET:
        _check_attempt_transition(old, cmd.status)
        if cmd.status != old.status:
            changes["status"] = cmd.status
            if cmd.status in ENDING_ATTEMPT_STATUSES:
                changes["end_time"] = now
            elif cmd.status == "running" and old.end_time is not None:
                changes["end_time"] = None
    if cmd.worker_id is not UNSET and cmd.worker_id != old.worker_id:
        changes["worker_id"] = cmd.worker_id
    if cmd.last_heartbeat_time is not UNSET and cmd.last_heartbeat_time != old.last_heartbeat_time:
        changes["last_heartbeat_time"] = cmd.last_heartbeat_time
    if cmd.metadata is not UNSET and cmd.metadata != old.metadata:
        changes["metadata"] = cmd.metadata
    if not changes:
        return []
    new = msgspec.structs.replace(old, **changes)
    status, end_time = _propagate(state, new, now)
    return [
        AttemptUpdated(
            time=now,
            rollout_id=old.rollout_id,
            attempt_id=old.attempt_id,
            rollout_status=status,
            rollout_end_time=end_time,
            **changes,
        )
    ]


def _decide_update_rollout(state: RolloutState, cmd: UpdateRollout, now: float) -> list[RolloutEvent]:
    old = state.rollout
    changes: dict[str, Any] = {}
    for name in ("input", "mode", "resources_id", "metadata"):
        value = getattr(cmd, name)
        if value is not UNSET and value != getattr(old, name):
            changes[name] = value
    if cmd.config is not UNSET:
        if not isinstance(cmd.config, RolloutConfig):
            raise InvalidInputError("config must be a RolloutConfig")
        changes["config"] = cmd.config
    if cmd.status is not UNSET:
        if cmd.status not in ROLLOUT_STATUSES:
            raise InvalidInputError(
                f"unknown rollout status {cmd.status!r}; expected one of {sorted(ROLLOUT_STATUSES)}"
            )
        if old.status in TERMINAL_ROLLOUT_STATUSES and cmd.status != old.status and cmd.status not in QUEUING_STATUSES:
            raise InvalidTransitionError(
                f"rollout {old.rollout_id}",
                old.status,
                cmd.status,
                "a finished rollout can only be queued again",
            )
        if cmd.status != old.status:
            changes["status"] = cmd.status
            if cmd.status in TERMINAL_ROLLOUT_STATUSES:
                changes["end_time"] = now
    if not changes:
        return []
    updated = RolloutUpdated(time=now, rollout_id=old.rollout_id, **changes)
    if changes.get("status") != "cancelled":
        return [updated]
    return [*_end_attempts_of_cancel(state, updated, now), updated]


def _end_attempts_of_cancel(state: RolloutState, cancel: RolloutUpdated, now: float) -> list[RolloutEvent]:
    """The attempts not yet finished when their rollout is cancelled, recorded ``failed`` with
    ``CANCELLED_REASON``, in attempt order, appended just before ``cancel``. The latest one's event
    carries the cancel itself (``rollout_status="cancelled"`` and its ``end_time``), the others move
    nothing (``_propagate``). So every prefix of the append is a state the rollout can be in: on
    JetStream a command's messages are separate publishes, and one that fails half-way (NATS lost)
    must not leave a rollout ``running`` whose latest attempt ended ``failed``, which nothing would
    ever move again. And a subscriber's record of the latest attempt, yielded at its event, shows it
    ``failed`` under its ``cancelled`` rollout, as the read model has them after the append."""
    cancelled = evolve(state, cancel)
    assert cancelled is not None
    failed: AttemptStatus = "failed"
    ends = [
        (a.attempt_id, failed, CANCELLED_REASON) for a in cancelled.attempts if a.status not in FINAL_ATTEMPT_STATUSES
    ]
    events = _end_attempts(cancelled, ends, now)
    latest = cancelled.latest
    if events and latest is not None and ends[-1][0] == latest.attempt_id:
        last = events[-1]
        assert isinstance(last, AttemptUpdated)
        end = cancelled.rollout.end_time
        events[-1] = msgspec.structs.replace(last, rollout_status="cancelled", rollout_end_time=end)
    return events


def _end_attempts(state: RolloutState, ends: list[tuple[str, AttemptStatus, str]], now: float) -> list[RolloutEvent]:
    """The events of ``(attempt_id, status, reason)`` ends, each decided on the state after the
    ones before it; the reason goes into the attempt's metadata (``STATUS_REASON``)."""
    events: list[RolloutEvent] = []
    for attempt_id, status, reason in ends:
        metadata = {**(state.attempt(attempt_id).metadata or {}), STATUS_REASON: reason}
        update = UpdateAttempt(attempt_id=attempt_id, status=status, metadata=metadata)
        for event in _decide_update_attempt(state, update, now):
            events.append(event)
            evolved = evolve(state, event)
            assert evolved is not None
            state = evolved
    return events


def _decide_health(state: RolloutState, now: float) -> list[RolloutEvent]:
    """The watchdog's events: every attempt still live, whatever its rollout's status (a runner
    revived by a late span after its rollout finished or its retry was claimed, which vanished
    again); only the latest one of a rollout in flight moves the rollout (``_propagate``)."""
    ends = []
    for attempt in state.attempts:
        if attempt.status in LIVE_ATTEMPT_STATUSES and (found := _overdue(attempt, state.rollout.config, now)):
            ends.append((attempt.attempt_id, *found))
    return _end_attempts(state, ends, now)


def _overdue(attempt: Attempt, cfg: RolloutConfig, now: float) -> tuple[AttemptStatus, str] | None:
    """``(status, reason)`` when a live ``attempt`` ran past ``cfg``'s limits at ``now``, else ``None``."""
    if cfg.timeout_seconds is not None and now - attempt.start_time > cfg.timeout_seconds:
        return "timeout", f"timeout: ran {now - attempt.start_time:.1f} s, over timeout_seconds={cfg.timeout_seconds:g}"
    if cfg.unresponsive_seconds is not None:
        last = attempt.last_heartbeat_time if attempt.last_heartbeat_time is not None else attempt.start_time
        if now - last > cfg.unresponsive_seconds:
            return "unresponsive", (
                f"unresponsive: no span or heartbeat for {now - last:.1f} s, "
                f"over unresponsive_seconds={cfg.unresponsive_seconds:g}"
            )
    return None


def _decide_abandon(state: RolloutState, cmd: AbandonAttempt, now: float) -> list[RolloutEvent]:
    attempt = state.attempt(cmd.attempt_id)
    if attempt.status in FINAL_ATTEMPT_STATUSES:
        return []
    metadata = {**(attempt.metadata or {}), STATUS_REASON: cmd.reason}
    update = UpdateAttempt(attempt_id=attempt.attempt_id, status="failed", metadata=metadata)
    return _decide_update_attempt(state, update, now)


def decide(state: RolloutState | None, command: Command, now: float) -> list[RolloutEvent]:
    """Turn a command on one rollout into the events that record it.

    Args:
        state: The rollout's current state, ``None`` if it does not exist yet.
        command: What a caller asks for.
        now: The current wall-clock time in seconds.

    Returns:
        Zero or more events; an empty list means the command changes nothing.

    Raises:
        InvalidTransitionError: The command breaks a rule of the state machines above.
        AttemptNotFoundError: The command names an attempt the rollout does not have.
        InvalidInputError: A malformed command (unknown status, creating an existing rollout).
    """
    if isinstance(command, CreateRollout):
        if state is not None:
            raise InvalidInputError(f"rollout {command.rollout_id} already exists")
        return _decide_create(command, now)
    if state is None:
        raise InvalidInputError("the rollout does not exist")
    if isinstance(command, StartAttempt):
        return _decide_start(state, command, now)
    if isinstance(command, UpdateAttempt):
        return _decide_update_attempt(state, command, now)
    if isinstance(command, UpdateRollout):
        return _decide_update_rollout(state, command, now)
    if isinstance(command, CheckHealth):
        return _decide_health(state, now)
    if isinstance(command, AbandonAttempt):
        return _decide_abandon(state, command, now)
    raise InvalidInputError(f"unknown command {type(command).__name__}")
