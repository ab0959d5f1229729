"""Immutable, tagged, versioned events: the only thing eventlight writes.

Each event is a frozen ``msgspec.Struct`` with a stable tag (the ``"type"`` field on disk, never a
Python path) and a ``v`` schema version. New fields get defaults; a breaking change bumps ``v`` and
adds an upcaster to ``UPCASTERS`` (see ``decode_event``).

State events carry the snapshot they produce (the attempt or rollout after the change), so that
``evolve`` is a replacement and a replay can never disagree with the projection. Which events exist:

=====================  ==========================  =====================================================
event                  subject (``el.<ns>.…``)     meaning
=====================  ==========================  =====================================================
RolloutCreated         ``r.<rid>.q`` or ``.e``     ``enqueue_rollout`` (queued) or ``start_rollout``
AttemptStarted         ``r.<rid>.e``               a runner claimed the rollout / ``start_attempt``
AttemptUpdated         ``r.<rid>.e`` or ``.q``     an attempt changed; ``.q`` when the rollout requeues
RolloutUpdated         ``r.<rid>.e`` or ``.q``     ``update_rollout`` (cancel, edit, manual requeue)
SpansAdded             ``s.<rid>.<aid>``           a batch of spans of one attempt (also a heartbeat), or
                                                   with no spans a reservation of sequence ids
ResourcesPut           ``res.<resources_id>``      ``add_resources`` / ``update_resources``
WorkerHeartbeat        ``w.<worker_id>``           ``update_worker``
WorkerIdle             ``w.<worker_id>``           a worker polled an empty queue
=====================  ==========================  =====================================================

Messages on ``r.*.q`` are what runners consume as a work queue.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventlight.errors import InvalidInputError
from eventlight.types import (
    QUEUING_STATUSES,
    Attempt,
    ResourcesUpdate,
    Rollout,
    Span,
)


class _Base(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = 1
    time: float


class RolloutCreated(_Base, frozen=True, tag="rollout_created"):
    rollout: Rollout


class AttemptStarted(_Base, frozen=True, tag="attempt_started"):
    attempt: Attempt
    rollout_status: str = "preparing"


class AttemptUpdated(_Base, frozen=True, tag="attempt_updated"):
    attempt: Attempt
    rollout_status: str | None = None
    """The rollout's new status when this attempt is the latest and it changed; else ``None``."""
    rollout_end_time: float | None = None


class RolloutUpdated(_Base, frozen=True, tag="rollout_updated"):
    rollout: Rollout


class SpansAdded(_Base, frozen=True, tag="spans_added"):
    rollout_id: str
    attempt_id: str
    spans: list[Span]
    seq_high: int = 0
    """The attempt's highest allocated span sequence id once this event is written (the counter
    ``get_next_span_sequence_id`` continues from). Appends on ``s.<rid>.<aid>`` expect that subject's
    last sequence, so the stream itself is the counter. ``0`` in events written before the field existed."""


class ResourcesPut(_Base, frozen=True, tag="resources_put"):
    resources: ResourcesUpdate


class WorkerHeartbeat(_Base, frozen=True, tag="worker_heartbeat"):
    worker_id: str
    heartbeat_stats: dict[str, Any] | None = None


class WorkerIdle(_Base, frozen=True, tag="worker_idle"):
    worker_id: str


RolloutEvent = RolloutCreated | AttemptStarted | AttemptUpdated | RolloutUpdated
AnyEvent = (
    RolloutCreated
    | AttemptStarted
    | AttemptUpdated
    | RolloutUpdated
    | SpansAdded
    | ResourcesPut
    | WorkerHeartbeat
    | WorkerIdle
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)

UPCASTERS: dict[tuple[str, int], Any] = {}
"""``(tag, version) -> fn(dict) -> dict`` for events written by an older schema."""


def encode_event(event: AnyEvent) -> bytes:
    """Encode an event as JSON bytes (the JetStream payload)."""
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Decode a payload, upcasting old versions.

    An event's ``v`` must be its type's current version, or one ``UPCASTERS`` upcasts: an event of a
    newer version, even one whose fields happen to fit this version's type, is refused rather than
    read with the wrong meaning (the projector dead-letters it; a newer eventlight replays it).

    Raises:
        InvalidInputError: The payload is not a known event, or not a version this code reads.
    """
    try:
        event = _decoder.decode(data)
    except msgspec.ValidationError as e:
        upcast = _upcaster(data)
        if upcast is None:
            raise InvalidInputError(f"not an eventlight event: {e}") from e
        return _upcast(upcast, data)
    except (msgspec.DecodeError, RecursionError, TypeError) as e:  # RecursionError: nested too deep
        raise InvalidInputError(f"not an eventlight event: {e}") from e
    current = _current_version(type(event))
    if event.v == current:
        return event
    upcast = _upcaster(data)
    if upcast is not None:
        return _upcast(upcast, data)
    tag = type(event).__struct_config__.tag
    newer = " (written by a newer eventlight)" if event.v > current else ""
    raise InvalidInputError(f"not an eventlight event this version reads: {tag} v{event.v}{newer}, read v{current}")


def _upcast(upcast: Any, data: bytes) -> AnyEvent:
    try:
        return msgspec.convert(upcast(msgspec.json.decode(data)), AnyEvent)  # type: ignore[arg-type]
    except (msgspec.DecodeError, RecursionError) as e:  # includes ValidationError
        raise InvalidInputError(f"not an eventlight event (after upcasting): {e}") from e


_CURRENT_VERSIONS: dict[type, int] = {}


def _current_version(cls: type) -> int:
    """The default of ``cls``'s ``v`` field: the version this code writes and reads as is."""
    v = _CURRENT_VERSIONS.get(cls)
    if v is None:
        v = next(f.default for f in msgspec.structs.fields(cls) if f.name == "v")
        _CURRENT_VERSIONS[cls] = v
    return v


def _upcaster(data: bytes) -> Any:
    """The upcaster for a payload's ``(type, v)``, or ``None`` (not JSON, not an object, no upcaster)."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):  # the typed decoder can fail on a type first
        return None
    if not isinstance(raw, dict):
        return None
    tag, version = raw.get("type"), raw.get("v", 1)
    if not isinstance(tag, str) or not isinstance(version, int):
        return None
    return UPCASTERS.get((tag, version))


def rollout_id_of(event: AnyEvent) -> str | None:
    """The rollout an event belongs to, if any."""
    if isinstance(event, (RolloutCreated, RolloutUpdated)):
        return event.rollout.rollout_id
    if isinstance(event, (AttemptStarted, AttemptUpdated)):
        return event.attempt.rollout_id
    if isinstance(event, SpansAdded):
        return event.rollout_id
    return None


def enters_queue(event: AnyEvent) -> bool:
    """Whether the event puts its rollout on the runners' work queue."""
    if isinstance(event, (RolloutCreated, RolloutUpdated)):
        return event.rollout.status in QUEUING_STATUSES
    if isinstance(event, AttemptUpdated):
        return event.rollout_status in QUEUING_STATUSES
    return False


def subject_for(prefix: str, event: AnyEvent) -> str:
    """The JetStream subject an event is published on; ``prefix`` is ``el.<ns>``."""
    if isinstance(event, SpansAdded):
        return f"{prefix}.s.{event.rollout_id}.{event.attempt_id}"
    if isinstance(event, ResourcesPut):
        return f"{prefix}.res.{event.resources.resources_id}"
    if isinstance(event, (WorkerHeartbeat, WorkerIdle)):
        return f"{prefix}.w.{event.worker_id}"
    rid = rollout_id_of(event)
    return f"{prefix}.r.{rid}.{'q' if enters_queue(event) else 'e'}"
