"""The JetStream subject layout of one namespace (``el.<ns>``; stream ``EL_<NS>``).

========================  =====================================================================
subject                   events
========================  =====================================================================
``r.<rid>.q``             rollout events that put the rollout on the runners' work queue
``r.<rid>.e``             every other rollout event (appends fence on ``r.<rid>.>``)
``s.<rid>.<aid>``         span batches and sequence-id reservations of one attempt
``res.<resources_id>``    resources snapshots
``w.<worker_id>``         worker heartbeats and empty polls
========================  =====================================================================
"""

from __future__ import annotations

from eventlight.core.events import (
    AnyEvent,
    ResourcesPut,
    SpansAdded,
    WorkerHeartbeat,
    WorkerIdle,
    enters_queue,
    rollout_id_of,
)


def subject_for(prefix: str, event: AnyEvent) -> str:
    """The subject an event is published on; ``prefix`` is ``el.<ns>``."""
    if isinstance(event, SpansAdded):
        return f"{prefix}.s.{event.rollout_id}.{event.attempt_id}"
    if isinstance(event, ResourcesPut):
        return f"{prefix}.res.{event.resources.resources_id}"
    if isinstance(event, (WorkerHeartbeat, WorkerIdle)):
        return f"{prefix}.w.{event.worker_id}"
    rid = rollout_id_of(event)
    return f"{prefix}.r.{rid}.{'q' if enters_queue(event) else 'e'}"


def rollout_filter(prefix: str, rollout_id: str) -> str:
    """Every state subject of a rollout (the fence of its appends)."""
    return f"{prefix}.r.{rollout_id}.>"


def span_subject(prefix: str, rollout_id: str, attempt_id: str) -> str:
    """An attempt's span subject (its sequence-id counter)."""
    return f"{prefix}.s.{rollout_id}.{attempt_id}"


def rollout_of_subject(subject: str) -> str:
    """The rollout id of an ``el.<ns>.r.<rid>.*`` or ``el.<ns>.s.<rid>.*`` subject."""
    return subject.split(".")[3]
