"""Immutable, tagged, versioned events: the only thing eventlight writes.

Each event is a frozen ``msgspec.Struct`` with a stable tag (the ``"type"`` field on disk, never a
Python path) and a ``v`` schema version. New fields get defaults; a breaking change bumps ``v`` and
adds an upcaster to ``UPCASTERS`` (see ``decode_event``).

Events record facts: a creation carries what was created; an update carries only the fields it
changed (``msgspec.UNSET`` fields are left out of the payload and mean "unchanged"), so a writer
that decided on an older state can never overwrite newer fields. Version 1 of ``AttemptUpdated``
and ``RolloutUpdated`` carried whole snapshots; their upcasters read them as "every field set".

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

The subjects are the JetStream backend's layout (``eventlight.store.jetstream.layout``); the
in-memory backend keeps the same events in a list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from eventlight.core.errors import InvalidInputError
from eventlight.core.types import (
    QUEUING_STATUSES,
    Attempt,
    AttemptStatus,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    Span,
)


class _Base(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = 1
    time: float


class RolloutCreated(_Base, frozen=True, kw_only=True, tag="rollout_created"):
    """A rollout was created (queued, or started with its first attempt in the next event)."""

    rollout: Rollout


class AttemptStarted(_Base, frozen=True, kw_only=True, tag="attempt_started"):
    """A new attempt (claim or ``start_attempt``); the rollout moves to ``rollout_status``."""

    attempt: Attempt
    rollout_status: RolloutStatus = "preparing"


class AttemptUpdated(_Base, frozen=True, kw_only=True, tag="attempt_updated"):
    """Fields of one attempt changed; ``UNSET`` fields did not."""

    v: int = 2
    rollout_id: str
    attempt_id: str
    status: AttemptStatus | UnsetType = UNSET
    end_time: float | None | UnsetType = UNSET
    worker_id: str | None | UnsetType = UNSET
    last_heartbeat_time: float | None | UnsetType = UNSET
    metadata: dict[str, Any] | None | UnsetType = UNSET
    rollout_status: RolloutStatus | None = None
    """The rollout's new status when this attempt is the latest and it changed; else ``None``."""
    rollout_end_time: float | None = None


class RolloutUpdated(_Base, frozen=True, kw_only=True, tag="rollout_updated"):
    """Fields of a rollout changed (``update_rollout``); ``UNSET`` fields did not."""

    v: int = 2
    rollout_id: str
    input: Any | UnsetType = UNSET
    mode: str | None | UnsetType = UNSET
    resources_id: str | None | UnsetType = UNSET
    status: RolloutStatus | UnsetType = UNSET
    end_time: float | None | UnsetType = UNSET
    config: RolloutConfig | UnsetType = UNSET
    metadata: dict[str, Any] | None | UnsetType = UNSET


class SpansAdded(_Base, frozen=True, kw_only=True, tag="spans_added"):
    """A batch of one attempt's spans (a heartbeat), or with no spans a reservation of sequence ids."""

    rollout_id: str
    attempt_id: str
    spans: list[Span]
    seq_high: int = 0
    """The attempt's highest allocated span sequence id once this event is written (the counter
    ``get_next_span_sequence_id`` continues from). ``0`` in events written before the field existed."""


class ResourcesPut(_Base, frozen=True, kw_only=True, tag="resources_put"):
    """A resources snapshot was created or replaced (the whole snapshot is the fact)."""

    resources: ResourcesUpdate


class WorkerHeartbeat(_Base, frozen=True, kw_only=True, tag="worker_heartbeat"):
    """``update_worker``: a runner is alive."""

    worker_id: str
    heartbeat_stats: dict[str, Any] | None = None


class WorkerIdle(_Base, frozen=True, kw_only=True, tag="worker_idle"):
    """A worker polled an empty queue."""

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

_ATTEMPT_FIELDS = ("status", "end_time", "worker_id", "last_heartbeat_time", "metadata")
_ROLLOUT_FIELDS = ("input", "mode", "resources_id", "status", "end_time", "config", "metadata")


def _attempt_updated_v1(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 shipped the whole attempt after the change: read it as every field set."""
    attempt = raw.get("attempt") or {}
    out: dict[str, Any] = {k: raw[k] for k in ("type", "time", "rollout_status", "rollout_end_time") if k in raw}
    out.update(v=2, rollout_id=attempt.get("rollout_id"), attempt_id=attempt.get("attempt_id"))
    out.update({k: attempt[k] for k in _ATTEMPT_FIELDS if k in attempt})
    return out


def _rollout_updated_v1(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 shipped the whole rollout after the change: read it as every field set."""
    rollout = raw.get("rollout") or {}
    out = {"type": raw.get("type"), "time": raw.get("time"), "v": 2, "rollout_id": rollout.get("rollout_id")}
    out.update({k: rollout[k] for k in _ROLLOUT_FIELDS if k in rollout})
    return out


UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {
    ("attempt_updated", 1): _attempt_updated_v1,
    ("rollout_updated", 1): _rollout_updated_v1,
}
"""``(tag, version) -> fn(dict) -> dict`` for events written by an older schema."""

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


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
    except (msgspec.DecodeError, RecursionError, TypeError, UnicodeDecodeError) as e:  # nested too deep; bad UTF-8
        raise InvalidInputError(f"not an eventlight event: {e}") from e
    current = _current_version(type(event))
    if event.v == current:
        decoded: AnyEvent = event
        return decoded
    upcast = _upcaster(data)
    if upcast is not None:
        return _upcast(upcast, data)
    tag = type(event).__struct_config__.tag
    newer = " (written by a newer eventlight)" if event.v > current else ""
    raise InvalidInputError(f"not an eventlight event this version reads: {tag} v{event.v}{newer}, read v{current}")


def _upcast(upcast: Callable[[dict[str, Any]], dict[str, Any]], data: bytes) -> AnyEvent:
    try:
        upcasted: AnyEvent = msgspec.convert(upcast(msgspec.json.decode(data)), AnyEvent)  # type: ignore[arg-type]
        return upcasted
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as e:  # includes ValidationError
        raise InvalidInputError(f"not an eventlight event (after upcasting): {e}") from e


_CURRENT_VERSIONS: dict[type[Any], int] = {}


def _current_version(cls: type[Any]) -> int:
    """The default of ``cls``'s ``v`` field: the version this code writes and reads as is."""
    v = _CURRENT_VERSIONS.get(cls)
    if v is None:
        v = next(f.default for f in msgspec.structs.fields(cls) if f.name == "v")
        _CURRENT_VERSIONS[cls] = v
    return v


def _upcaster(data: bytes) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """The upcaster for a payload's ``(type, v)``, or ``None`` (not JSON, not an object, no upcaster)."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # the typed decoder can fail on a type first
        return None
    if not isinstance(raw, dict):
        return None
    tag, version = raw.get("type"), raw.get("v", 1)
    if not isinstance(tag, str) or not isinstance(version, int):
        return None
    return UPCASTERS.get((tag, version))


def rollout_id_of(event: AnyEvent) -> str | None:
    """The rollout an event belongs to, if any."""
    if isinstance(event, RolloutCreated):
        return event.rollout.rollout_id
    if isinstance(event, AttemptStarted):
        return event.attempt.rollout_id
    if isinstance(event, (AttemptUpdated, RolloutUpdated, SpansAdded)):
        return event.rollout_id
    return None


def enters_queue(event: AnyEvent) -> bool:
    """Whether the event puts its rollout on the runners' work queue."""
    if isinstance(event, RolloutCreated):
        return event.rollout.status in QUEUING_STATUSES
    if isinstance(event, RolloutUpdated):
        return event.status in QUEUING_STATUSES
    if isinstance(event, AttemptUpdated):
        return event.rollout_status in QUEUING_STATUSES
    return False


def leaves_queue(event: AnyEvent) -> bool:
    """Whether the event takes its rollout off the runners' work queue (a claim, a cancel, a finish).

    A queue entry of a rollout that has such an event after it can never be claimed: any later
    return to the queue is an event of its own (``enters_queue``), with an entry of its own.
    """
    if isinstance(event, AttemptStarted):
        return event.rollout_status not in QUEUING_STATUSES
    if isinstance(event, RolloutUpdated):
        return not isinstance(event.status, UnsetType) and event.status not in QUEUING_STATUSES
    if isinstance(event, AttemptUpdated):
        return event.rollout_status is not None and event.rollout_status not in QUEUING_STATUSES
    return False
