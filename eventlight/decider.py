"""The pure decider: every status transition of rollouts, attempts and workers.

``decide(state, command, now) -> list[event]`` and ``evolve(state, event) -> state`` are synchronous,
do no I/O and take the clock as an argument. The in-memory backend, the JetStream backend, the
projector, the watchdog and ``eventlight replay`` all call them, so they cannot disagree.

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

Rollout (an aggregated view of its latest attempt)
    * Only the latest attempt (highest ``sequence_id``) moves the rollout (C01).
    * latest attempt ``preparing``/``running``/``succeeded`` → same rollout status.
    * ``failed``/``timeout``/``unresponsive`` → ``requeuing`` if the status is in ``retry_condition``
      and ``sequence_id < max_attempts``, else ``failed``.
    * ``cancelled`` only by ``update_rollout``; a cancelled rollout stays cancelled whatever its
      attempts do afterwards (0.3.0 lets a late attempt overwrite it; the docs call it terminal).
    * A terminal rollout may only be sent back to ``queuing``/``requeuing`` by ``update_rollout``.
    * ``end_time`` is set when the rollout becomes terminal.

Worker (derived, never set directly)
    * a claim → ``busy``; attempt ``succeeded``/``failed`` → ``idle``; ``timeout``/``unresponsive`` →
      ``unknown``; an empty poll → ``idle``; heartbeats only stamp ``last_heartbeat_time``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventlight.errors import AttemptNotFoundError, InvalidInputError, InvalidTransitionError
from eventlight.events import (
    AnyEvent,
    AttemptStarted,
    AttemptUpdated,
    RolloutCreated,
    RolloutEvent,
    RolloutUpdated,
    SpansAdded,
    WorkerHeartbeat,
    WorkerIdle,
)
from eventlight.types import (
    ATTEMPT_STATUSES,
    QUEUING_STATUSES,
    ROLLOUT_STATUSES,
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    AttemptedRollout,
    Rollout,
    RolloutConfig,
    Worker,
)

FINAL_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout"})


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""Default of optional update arguments: "leave as is", distinct from an explicit ``None``."""


class RolloutState(msgspec.Struct, frozen=True):
    """Everything the decider knows of one rollout: the rollout and all its attempts in order."""

    rollout: Rollout
    attempts: tuple[Attempt, ...] = ()

    @property
    def latest(self) -> Attempt | None:
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


# ---------------------------------------------------------------------------------------------
# Commands


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
    attempt_id: str
    status: Any = UNSET
    worker_id: Any = UNSET
    last_heartbeat_time: Any = UNSET
    metadata: Any = UNSET


class UpdateRollout(msgspec.Struct, frozen=True, kw_only=True):
    input: Any = UNSET
    mode: Any = UNSET
    resources_id: Any = UNSET
    status: Any = UNSET
    config: Any = UNSET
    metadata: Any = UNSET


class CheckHealth(msgspec.Struct, frozen=True, kw_only=True):
    """The watchdog's command: mark the latest attempt ``timeout``/``unresponsive`` when overdue."""


Command = CreateRollout | StartAttempt | UpdateAttempt | UpdateRollout | CheckHealth


# ---------------------------------------------------------------------------------------------
# Pure rules


def rollout_status_from_attempt(attempt: Attempt, config: RolloutConfig) -> str:
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


def _check_attempt_transition(attempt: Attempt, status: str) -> None:
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


def _propagate(state: RolloutState, attempt: Attempt, now: float) -> tuple[str | None, float | None]:
    """Rollout status (and end time) after ``attempt`` changed, or ``(None, None)`` if unchanged."""
    rollout = state.rollout
    latest = state.latest
    if latest is None or latest.attempt_id != attempt.attempt_id or rollout.status == "cancelled":
        return None, None
    new = rollout_status_from_attempt(attempt, rollout.config)
    if new == rollout.status:
        return None, None
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
            if cmd.status in ("succeeded", "failed", "timeout", "unresponsive"):
                changes["end_time"] = now
            elif cmd.status == "running":
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
    return [AttemptUpdated(time=now, attempt=new, rollout_status=status, rollout_end_time=end_time)]


def _decide_update_rollout(state: RolloutState, cmd: UpdateRollout, now: float) -> list[RolloutEvent]:
    old = state.rollout
    changes: dict[str, Any] = {}
    for name in ("input", "mode", "resources_id", "metadata"):
        value = getattr(cmd, name)
        if value is not UNSET:
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
    return [RolloutUpdated(time=now, rollout=msgspec.structs.replace(old, **changes))]


def _decide_health(state: RolloutState, now: float) -> list[RolloutEvent]:
    rollout, attempt = state.rollout, state.latest
    if attempt is None or rollout.status not in ("preparing", "running"):
        return []
    if attempt.status not in ("preparing", "running"):
        return []
    cfg = rollout.config
    status: str | None = None
    if cfg.timeout_seconds is not None and now - attempt.start_time > cfg.timeout_seconds:
        status = "timeout"
    elif cfg.unresponsive_seconds is not None:
        last = attempt.last_heartbeat_time if attempt.last_heartbeat_time is not None else attempt.start_time
        if now - last > cfg.unresponsive_seconds:
            status = "unresponsive"
    if status is None:
        return []
    return _decide_update_attempt(state, UpdateAttempt(attempt_id=attempt.attempt_id, status=status), now)


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
    raise InvalidInputError(f"unknown command {type(command).__name__}")


# ---------------------------------------------------------------------------------------------
# Evolve


def _replace_attempt(attempts: tuple[Attempt, ...], new: Attempt) -> tuple[Attempt, ...]:
    return tuple(new if a.attempt_id == new.attempt_id else a for a in attempts)


def _evolve_spans(state: RolloutState, event: SpansAdded) -> RolloutState:
    if not event.spans:  # a reservation of sequence ids is not a heartbeat
        return state
    try:
        attempt = state.attempt(event.attempt_id)
    except AttemptNotFoundError:
        return state
    heartbeat = max([event.time, *(attempt.last_heartbeat_time or 0.0,)])
    changes: dict[str, Any] = {"last_heartbeat_time": heartbeat}
    if attempt.status in ("preparing", "unresponsive"):
        changes["status"] = "running"
        changes["end_time"] = None
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
        rollout = state.rollout
        if event.rollout_status is not None:
            end = event.rollout_end_time if event.rollout_end_time is not None else rollout.end_time
            rollout = msgspec.structs.replace(rollout, status=event.rollout_status, end_time=end)
        attempt = event.attempt
        try:
            known = state.attempt(attempt.attempt_id).last_heartbeat_time
        except AttemptNotFoundError:
            known = None
        if known is not None and (attempt.last_heartbeat_time or 0.0) < known:
            # the writer decided without the span heartbeats the log holds; keep the newest one
            attempt = msgspec.structs.replace(attempt, last_heartbeat_time=known)
        return RolloutState(rollout=rollout, attempts=_replace_attempt(state.attempts, attempt))
    if isinstance(event, RolloutUpdated):
        return RolloutState(rollout=event.rollout, attempts=state.attempts)
    if isinstance(event, SpansAdded):
        return _evolve_spans(state, event)
    return state


def evolve_worker(worker: Worker | None, event: AnyEvent, worker_id: str) -> Worker | None:
    """Derive worker ``worker_id``'s record from an event; ``None`` if the event does not concern it."""
    w = worker or Worker(worker_id=worker_id)
    if isinstance(event, WorkerHeartbeat) and event.worker_id == worker_id:
        return msgspec.structs.replace(
            w,
            last_heartbeat_time=event.time,
            heartbeat_stats=event.heartbeat_stats if event.heartbeat_stats is not None else w.heartbeat_stats,
        )
    if isinstance(event, WorkerIdle) and event.worker_id == worker_id:
        changes: dict[str, Any] = {"last_dequeue_time": event.time, "status": "idle"}
        if w.status != "idle":
            changes["last_idle_time"] = event.time
        return msgspec.structs.replace(w, **changes)
    if isinstance(event, AttemptStarted) and event.attempt.worker_id == worker_id:
        return msgspec.structs.replace(
            w,
            status="busy",
            last_dequeue_time=event.time,
            last_busy_time=event.time,
            current_rollout_id=event.attempt.rollout_id,
            current_attempt_id=event.attempt.attempt_id,
        )
    if isinstance(event, AttemptUpdated) and event.attempt.worker_id == worker_id:
        status = event.attempt.status
        if status in ("succeeded", "failed", "timeout", "unresponsive"):
            if w.current_attempt_id not in (None, event.attempt.attempt_id):
                return w  # the worker already moved on to another attempt
            return msgspec.structs.replace(
                w,
                status="idle" if status in ("succeeded", "failed") else "unknown",
                last_idle_time=event.time,
                current_rollout_id=None,
                current_attempt_id=None,
            )
        return msgspec.structs.replace(
            w,
            status="busy",
            last_busy_time=event.time,
            current_rollout_id=event.attempt.rollout_id,
            current_attempt_id=event.attempt.attempt_id,
        )
    return None


def workers_of(event: AnyEvent) -> list[str]:
    """The worker ids an event may change."""
    if isinstance(event, (WorkerHeartbeat, WorkerIdle)):
        return [event.worker_id]
    if isinstance(event, (AttemptStarted, AttemptUpdated)) and event.attempt.worker_id:
        return [event.attempt.worker_id]
    return []
